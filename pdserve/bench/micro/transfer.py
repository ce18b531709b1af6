"""KV transfer throughput of each transport against this machine's ceilings, same run.

For 1k, 4k and 16k tokens in the default model's KV layout (SmolLM2-135M on vLLM's
CPU backend: 30 layers, each ``(num_blocks, 3, 128, 128)``, block size 128) and for
float32 (what ``--dtype auto`` picks here) and bfloat16, one process serves the
blocks (the prefill side) and this process pulls them (the decode side), per
transport (tcp, ucx, torch). Ceilings measured in the same run over the same bytes:
``memcpy`` (torch ``copy_`` of the same per-layer chunks, one process) and ``socket``
(a raw TCP stream over loopback between two processes, ``sendall``/``recv_into`` on
preallocated buffers, the same socket buffer sizes). Each figure is the median of
``--reps`` pulls after one warm-up; the ratios are transport ÷ socket and ÷ memcpy.

    pdserve bench transfer                       # --reps 5
    pdserve bench transfer --transports tcp,ucx --tokens 4096 --checksum
    pdserve bench transfer --device cuda --transports tcp,ucx   # KV in GPU memory
    pdserve bench transfer --transports tcp,tcp+tls --tokens 1024,4096,16384
    sudo pdserve bench transfer --transports tcp --link-gbit 1,10,25   # two hosts

``tcp+tls`` is tcp with mutual TLS on both ends (certificates from a throwaway CA,
``pdserve certs``); the verdict gives its GB/s over plain tcp's, row by row, the
cipher the two ends chose, and whether the CPU has AES instructions.

With ``--device cuda`` both sides keep the KV in GPU memory (``cuda:0``; the torch
transport's NCCL needs a second GPU for the serving side and is skipped without one).
``memcpy`` is then a device-to-device ``copy_`` (synchronised) and ``socket`` still
streams host memory: it is the link's ceiling, which tcp reaches only through staging.

With ``--link-gbit`` the serving process runs on one host and the pulling one on another
(network namespaces linked by a router, each link shaped by ``tc tbf``:
``pdserve.bench.hosts``; needs root), once per rate; each row then also gives the link's
rate and each transport's share of it (the target: ``TARGET_VS_LINK``). The raw socket
crosses the same link: it is what the link gives a single stream here. UCX is held to its
tcp transport there (``UCX_TLS=tcp``): between two hosts of one machine it would move
the KV through shared memory, past the link.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import ssl
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pdserve.bench import hosts
from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import TRANSFER_BLOCK_SIZE, TransferConfig
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.hardware import Hardware
from pdserve.kv_transfer.base import PeerAddress, TransportOptions, create_transport
from pdserve.kv_transfer.control.tls import KvTls, load_kv_tls
from pdserve.kv_transfer.control.wire import recv_into_exact, tune
from pdserve.kv_transfer.layout import KVLayout, as_bytes
from pdserve.kv_transfer.leases import LeaseTable

NUM_LAYERS, KV_HEADS, HEAD_DIM2 = 30, 3, 128
BLOCK_SIZE = TRANSFER_BLOCK_SIZE
TARGET_VS_SOCKET = 0.7  # ucx and tcp, for transfers of 4 MiB and more
TARGET_TLS_VS_TCP = 0.8  # tcp+tls, every size
TARGET_VS_LINK = 0.9  # tcp and ucx on a shaped link, for transfers of 4 MiB and more
TLS_SUFFIX = "+tls"


@dataclass
class Row:
    dtype: str
    tokens: int
    mib: float
    gbps: dict[str, float]  # name -> GB/s (median)
    link_gbit: float | None = None  # the hosts' link rate (None: one host, loopback)

    def vs_link(self, name: str) -> float | None:
        """``name``'s GB/s over the link's (None: loopback)."""
        return None if self.link_gbit is None else self.gbps[name] * 8 / self.link_gbit


def make_caches(num_blocks: int, dtype: torch.dtype, seed: int,
                device: str = "cpu") -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (NUM_LAYERS, num_blocks, KV_HEADS, BLOCK_SIZE, HEAD_DIM2)
    kv = torch.randn(shape, generator=gen).to(dtype).to(device)
    if kv.is_cuda:
        torch.cuda.synchronize()  # transports read it from other threads and streams
    return list(kv.unbind(0))  # views, like vLLM


def options_for(name: str, checksum: bool, tls: TlsFiles | None) -> TransportOptions:
    """``name``'s options: ``<transport>+tls`` gets the TLS contexts."""
    return TransportOptions(checksum=checksum,
                            tls=load_kv_tls(tls) if tls and name.endswith(TLS_SUFFIX) else None)


def start(name: str, kv: list[torch.Tensor], leases: LeaseTable,
          options: TransportOptions, host: str = "127.0.0.1") -> tuple[Any, int]:
    name = name.removesuffix(TLS_SUFFIX)
    caches = {f"layer.{i}": t for i, t in enumerate(kv)}
    layout = KVLayout.from_kv_caches(caches, kv[0].shape[0], BLOCK_SIZE)
    compat = {"model": "bench", "dtype": str(kv[0].dtype), "block_size": BLOCK_SIZE,
              "tp_size": 1, "layout": layout.describe()}
    transport = create_transport(name, options)
    port = transport.start(kv_caches=kv, layout=layout, leases=leases, compat=compat,
                           host=host, port=0)
    return transport, port


# ---- the serving process ----------------------------------------------------------

def serve(names: list[str], dtype_name: str, num_blocks: int, checksum: bool, device: str,
          tls: TlsFiles | None, cmds: mp.Queue, replies: mp.Queue,
          link: hosts.Host | None = None) -> None:
    """Prefill side: every transport over one set of KV tensors, plus a raw socket; on
    the link's host when given (listening on its address)."""
    host = "127.0.0.1"
    if link is not None:
        hosts.enter(link.netns)
        host = link.address
    torch.set_num_threads(1)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    kv = make_caches(num_blocks, getattr(torch, dtype_name), seed=1, device=device)
    host_kv = kv if device == "cpu" else make_caches(num_blocks, getattr(torch, dtype_name), 1)
    served = {}
    for name in names:
        table = LeaseTable()
        transport, port = start(name, kv, table, options_for(name, checksum, tls), host)
        served[name] = (transport, table, port)
    raw = socket.create_server((host, 0))
    replies.put({**{n: p for n, (_, _, p) in served.items()}, "socket": raw.getsockname()[1]})
    while True:
        cmd = cmds.get(timeout=3600)
        if cmd[0] == "stop":
            break
        if cmd[0] == "lease":
            served[cmd[1]][1].add(cmd[2], cmd[3], time.time() + 600)
            replies.put(True)
        elif cmd[0] == "socket":  # served beside the lease commands of the same rounds
            threading.Thread(target=_stream, args=(raw, host_kv, int(cmd[1]), int(cmd[2])),
                             daemon=True).start()
            replies.put(True)
    for transport, _, _ in served.values():
        transport.close()


def _stream(raw: socket.socket, kv: list[torch.Tensor], num_blocks: int, reps: int) -> None:
    conn, _ = raw.accept()
    tune(conn)
    with conn:
        for _ in range(reps):
            conn.recv(1)  # go
            for layer in kv:
                conn.sendall(as_bytes(layer[:num_blocks]))


# ---- measurements (the pulling process) --------------------------------------------

def gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def time_memcpy(src: list[torch.Tensor], dst: list[torch.Tensor], n: int) -> float:
    started = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        d[:n].copy_(s[:n])
    if dst[0].is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def time_socket(conn: socket.socket, dst: list[torch.Tensor], n: int) -> float:
    started = time.perf_counter()
    conn.sendall(b"g")
    for layer in dst:
        recv_into_exact(conn, as_bytes(layer[:n]))
    return time.perf_counter() - started


def time_transport(transport: Any, peer: PeerAddress, n: int, req: str) -> float:
    blocks = list(range(n))
    started = time.perf_counter()
    transport.pull(peer, req, blocks, blocks, time.monotonic() + 120)
    return time.perf_counter() - started


def run_dtype(dtype_name: str, names: list[str], tokens: list[int], reps: int,
              checksum: bool, device: str = "cpu", server_device: str = "cpu",
              tls: TlsFiles | None = None, link: hosts.Host | None = None) -> list[Row]:
    """One dtype's rows; with ``link`` the serving process runs on the link's host and
    the caller's thread is on the other one."""
    num_blocks = max(tokens) // BLOCK_SIZE
    ctx = mp.get_context("spawn")
    cmds, replies = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=serve, daemon=True, args=(
        names, dtype_name, num_blocks, checksum, server_device, tls, cmds, replies, link))
    proc.start()
    transports: dict[str, tuple[Any, int]] = {}
    try:
        ports = replies.get(timeout=300)
        dtype = getattr(torch, dtype_name)
        src = make_caches(num_blocks, dtype, seed=1, device=device)
        dst = make_caches(num_blocks, dtype, seed=2, device=device)
        # The raw socket streams host memory whatever the device (the link's ceiling).
        host_dst = dst if device == "cpu" else make_caches(num_blocks, dtype, seed=2)
        for name in names:
            transports[name] = (start(name, dst, LeaseTable(),
                                      options_for(name, checksum, tls))[0], ports[name])

        def ask(*cmd: Any) -> Any:
            cmds.put(cmd)
            return replies.get(timeout=60)

        rows = []
        for num_tokens in tokens:
            rows.append(measure_size(dtype_name, num_tokens, reps, (src, dst, host_dst),
                                     transports, link, ports["socket"], ask))
            print_row(rows[-1], names)
        return rows
    finally:
        for transport, _ in transports.values():
            transport.close()
        cmds.put(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()


def measure_size(dtype_name: str, num_tokens: int, reps: int,
                 caches: tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]],
                 transports: dict[str, tuple[Any, int]], link: hosts.Host | None,
                 socket_port: int, ask: Callable[..., Any]) -> Row:
    """One size, every method measured round-robin (from the serving side's ``link``
    host, or over loopback); ``ask`` sends the serving process a command and waits for
    its reply."""
    peer_host = link.address if link else "127.0.0.1"
    src, dst, host_dst = caches
    n = num_tokens // BLOCK_SIZE
    nbytes = sum(layer[:n].numel() * layer.element_size() for layer in src)
    ask("socket", n, reps + 1)
    timings: dict[str, list[float]] = {k: [] for k in ["memcpy", "socket", *transports]}
    with socket.create_connection((peer_host, socket_port)) as conn:
        tune(conn)
        # Round-robin, so a change in the machine's load hits every method alike;
        # round 0 is the warm-up (connections, groups, endpoints, page faults).
        for rep in range(reps + 1):
            timings["memcpy"].append(time_memcpy(src, dst, n))
            timings["socket"].append(time_socket(conn, host_dst, n))
            for name, (transport, port) in transports.items():
                req = f"{name}-{num_tokens}-{rep}"
                ask("lease", name, req, list(range(n)))
                timings[name].append(time_transport(transport, PeerAddress(peer_host, port),
                                                    n, req))
    timings = {k: v[1:] for k, v in timings.items()}
    return Row(dtype_name, num_tokens, nbytes / 2**20,
               {k: gbps(nbytes, v) for k, v in timings.items()},
               link.rate_gbit if link else None)


def print_row(row: Row, names: list[str]) -> None:
    g = row.gbps
    cells = [f"{row.dtype:>8} {row.tokens:>6} tok {row.mib:8.1f} MiB",
             f"memcpy {g['memcpy']:6.2f}", f"socket {g['socket']:6.2f}"]
    if row.link_gbit is not None:
        cells.insert(1, f"link {row.link_gbit / 8:6.2f}")
    for name in names:
        share = "" if (vs := row.vs_link(name)) is None else f", {vs:.2f}x link"
        cells.append(f"{name} {g[name]:6.2f} ({g[name] / g['socket']:.2f}x sock, "
                     f"{g[name] / g['memcpy']:.2f}x memcpy{share})")
    print(" | ".join(cells), flush=True)


def verdict(rows: list[Row], names: list[str]) -> None:
    for rate in sorted({r.link_gbit for r in rows if r.link_gbit is not None}):
        for name in [n for n in names if n in ("tcp", "ucx")]:
            shares = [r.vs_link(name) or 0.0 for r in rows
                      if r.link_gbit == rate and r.mib >= 4]
            worst = min(shares) if shares else float("nan")
            ok = "meets" if worst >= TARGET_VS_LINK else "MISSES"
            print(f"{name} on a {rate:g} Gbit/s link: worst {worst:.2f}x the link for >= 4 "
                  f"MiB; {ok} the {TARGET_VS_LINK}x target")
    for name in [n for n in names if n in ("tcp", "ucx")]:
        ratios = [r.gbps[name] / r.gbps["socket"] for r in rows if r.mib >= 4]
        worst = min(ratios) if ratios else float("nan")
        ok = "meets" if worst >= TARGET_VS_SOCKET else "MISSES"
        print(f"{name}: worst {worst:.2f}x socket for >= 4 MiB; {ok} the "
              f"{TARGET_VS_SOCKET}x target")
    for name in [n for n in names if n.endswith(TLS_SUFFIX)]:
        plain = name.removesuffix(TLS_SUFFIX)
        if plain not in names:
            continue
        ratios = [r.gbps[name] / r.gbps[plain] for r in rows]
        ok = "meets" if min(ratios) >= TARGET_TLS_VS_TCP else "MISSES"
        print(f"{name} / {plain}: " + ", ".join(
            f"{r.dtype} {r.tokens} tok {x:.2f}x" for r, x in zip(rows, ratios, strict=True))
            + f"; worst {min(ratios):.2f}x, {ok} the {TARGET_TLS_VS_TCP}x target")


def _no_tls() -> KvTls:
    raise RuntimeError("the throwaway CA's files gave no TLS contexts")


def tls_facts(tls: KvTls) -> dict[str, Any]:
    """The cipher two ends with these contexts agree on, and the CPU's AES flags."""
    a, b = socket.socketpair()
    with a, b:
        server = threading.Thread(target=lambda: tls.accept(a, time.monotonic() + 10).close())
        server.start()
        conn = tls.connect(b, "127.0.0.1", time.monotonic() + 10)
        cipher = conn.cipher()
        conn.close()
        server.join(10)
    flags = Hardware.detect().cpu_flags
    return {"cipher": cipher[0] if cipher else None, "protocol": cipher[1] if cipher else None,
            "openssl": ssl.OPENSSL_VERSION,
            "cpu_aes": {f: f in flags for f in ("aes", "vaes", "pclmulqdq", "vpclmulqdq")}}


# ---- P/D: share of TTFT spent on the transfer ---------------------------------------

def ttft_share(args: TransferConfig) -> dict[str, Any] | None:
    """With ``--pd``: the transfer's share of TTFT in a real P/D run, pull vs
    layer-wise push (``pdserve bench transfer-pd``, which also runs on its own)."""
    if not args.pd:
        return None
    from pdserve.bench.micro.transfer_pd import run_pd

    return run_pd(tokens=args.pd_tokens, reps=args.reps)


def _rows(args: TransferConfig, names: list[str], tokens: list[int],
          devices: tuple[str, str], tls: TlsFiles | None, link: hosts.Host | None = None
          ) -> list[Row]:
    """Every dtype's rows, on one host or (``link``) from the serving side's host."""
    return [row for dtype_name in args.dtypes.split(",")
            for row in run_dtype(dtype_name, names, tokens, args.reps, args.checksum,
                                 *devices, tls, link)]


def _linked_rows(args: TransferConfig, names: list[str], tokens: list[int],
                 devices: tuple[str, str], tls: TlsFiles | None, gbit: float) -> list[Row]:
    """Every dtype's rows between two hosts linked at ``gbit``."""
    print(f"-- two hosts, links at {gbit:g} Gbit/s ({gbit / 8:.3f} GB/s)", flush=True)
    with hosts.HostNet() as net:
        link = net.add("prefill", gbit)
        net.add("decode", gbit)
        with hosts.inside(net.hosts["decode"].netns):
            return _rows(args, names, tokens, devices, tls, link)


def run(args: TransferConfig) -> int:
    torch.set_num_threads(1)  # memcpy is one thread, like every transfer thread
    names = args.transport_names
    tokens = args.token_counts
    if args.link_rates:
        if why := hosts.prepare_process():
            print(f"--link-gbit needs hosts, and this machine cannot make them: {why}")
            return 2
        # Two hosts on one machine share its memory: left to choose, UCX moves the KV
        # through it (cma, posix), never touching the link. Hosts apart have a network.
        os.environ["UCX_TLS"] = "tcp"
    device = server_device = "cpu" if args.device == "cpu" else "cuda:0"
    if args.device == "cuda":
        torch.cuda.set_device(device)
        if "torch" in names:
            if torch.cuda.device_count() < 2:
                print("torch: skipped, NCCL needs a second GPU for the serving rank")
                names.remove("torch")
            else:
                server_device = "cuda:1"  # every transport's server then sits on cuda:1
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-tls-") as folder:  # the key too
        tls = facts = None
        if any(n.endswith(TLS_SUFFIX) for n in names):
            tls = make_test_ca(Path(folder))
            facts = tls_facts(load_kv_tls(tls) or _no_tls())
            print(f"TLS: {facts['protocol']} {facts['cipher']} ({facts['openssl']}); CPU "
                  + " ".join(f"{'+' if has else '-'}{f}" for f, has in facts["cpu_aes"].items()))
        devices = (device, server_device)
        rows = [row for gbit in args.link_rates
                for row in _linked_rows(args, names, tokens, devices, tls, gbit)
                ] if args.link_rates else _rows(args, names, tokens, devices, tls)
    verdict(rows, names)
    share = ttft_share(args)
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"transfer-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"args": asdict(args), "rows": [asdict(r) for r in rows],
                               "ttft_share": share, "tls": facts}, indent=2))
    print(f"results: {out}")
    return 0
