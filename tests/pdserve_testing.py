"""Helpers shared by the test suites (importable from spawned processes too)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import multiprocessing as mp
import os
import queue
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast

import httpx
import psutil
import torch

from pdserve.bench.load.sse import sse_events, token_ids
from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret, load_cluster_secret, write_cluster_secret
from pdserve.core.grpc_tls import GrpcTls, TlsFiles
from pdserve.core.types import WorkerLoadReport
from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions, create_transport
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.membership.local_etcd import gateway_keys
from pdserve.router.dispatch.workers.client import probe_load
from pdserve.worker.engine_tmp import sweep_dead

T = TypeVar("T")

# The helpers' HTTP client. ``httpx.get`` builds a client, and with it a TLS context,
# per call: ~20 ms of CPU, so a poll every 50 ms took most of a core from the engines
# loading beside it on two cores. No keep-alive: each request opens its own connection,
# as before (a server the test restarted leaves no stale one).
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))

NUM_BLOCKS = 16
LAYER_SHAPE = (NUM_BLOCKS, 3, 16, 128)  # the CPU backend's (blocks, heads, block, 2*head_dim)
# CUDA flash-attention's (2, blocks, block, heads, head_dim): the block dim is 1.
SPLIT_LAYER_SHAPE = (2, NUM_BLOCKS, 16, 3, 64)
# One KV set per (block dim, dtype): what the transport property tests draw from.
KV_KEYS = [(block_dim, dtype) for block_dim in (0, 1)
           for dtype in ("float32", "bfloat16", "float16")]
CORRUPT_KEY = (0, "float32", "corrupt")


def make_caches(seed: int, dtype: torch.dtype, num_layers: int = 4, block_dim: int = 0,
                device: str = "cpu") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = LAYER_SHAPE if block_dim == 0 else SPLIT_LAYER_SHAPE
    buf = torch.randn((num_layers, *shape), generator=gen).to(dtype).to(device)
    return {f"layer.{i}": buf[i] for i in range(num_layers)}  # views of one buffer, like vLLM


def compat(dtype: torch.dtype) -> dict[str, object]:
    return {"model": "m", "dtype": str(dtype), "block_size": 16, "tp_size": 1}


# The module an optional KV transport imports, and the package that installs it (the
# cpu and gpu extras both do).
TRANSPORT_PACKAGES = {"ucx": ("ucxx", "ucxx-cu12")}


def require_transport(name: str) -> None:
    """Raises, naming what to install, where transport ``name`` needs a package the
    install lacks: a test of a transport the install provides fails, never skips."""
    module, package = TRANSPORT_PACKAGES.get(name, ("", ""))
    if module and importlib.util.find_spec(module) is None:
        raise ModuleNotFoundError(f"the {name} transport needs {module}: pip install "
                                  f"{package} (pip install -e '.[cpu,test]' brings it)")


def start_transport(name: str, caches: dict[str, torch.Tensor], leases: LeaseTable,
                    options: TransportOptions | None = None, port: int = 0
                    ) -> tuple[KVTransport, int]:
    """A transport over ``caches``, serving on 127.0.0.1 (``port``; 0: any free one), as
    the worker side starts it."""
    require_transport(name)
    dtype = next(iter(caches.values())).dtype
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16)
    transport = create_transport(name, options)
    port = transport.start(kv_caches=list(caches.values()), layout=layout, leases=leases,
                           compat=dict(compat(dtype), layout=layout.describe()),
                           host="127.0.0.1", port=port)
    return transport, port


def kv_seed(block_dim: int, dtype_name: str) -> int:
    return 1000 + 10 * block_dim + ("float32", "bfloat16", "float16").index(dtype_name)


def corrupt_sends(transport: Any) -> None:
    """Test-only fault: the sender flips one byte of the first chunk it sends."""
    original = transport._send_blocks

    def send(conn: Any, msg: Any, chunks: list[torch.Tensor], first: int, deadline: float) -> int:
        bad = [c.clone() for c in chunks]
        bad[0].view(torch.uint8).view(-1)[0] ^= 0xFF
        return original(conn, msg, bad, first, deadline)

    transport._send_blocks = send


def kv_peer_main(name: str, options: dict[str, Any], device: str, cmds: mp.Queue,
                 replies: mp.Queue) -> None:
    """A process serving every KV set in ``KV_KEYS`` over transport ``name``, plus
    ``CORRUPT_KEY``: the (0, float32) set from a sender that corrupts its sends.

    Commands: ("lease", key, req, blocks) | ("status", key) | ("stop",).
    """
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    served: dict[Any, tuple[KVTransport, LeaseTable, int]] = {}
    for key in [*KV_KEYS, CORRUPT_KEY]:
        block_dim, dtype_name = cast(tuple[int, str], key[:2])
        caches = make_caches(kv_seed(block_dim, dtype_name), getattr(torch, dtype_name),
                             block_dim=block_dim, device=device)
        table = LeaseTable()
        transport, port = start_transport(name, caches, table, TransportOptions(**options))
        if key == CORRUPT_KEY:
            corrupt_sends(transport)
        served[key] = (transport, table, port)
    replies.put({key: port for key, (_, _, port) in served.items()})
    while True:
        cmd = cmds.get(timeout=600)
        if cmd[0] == "stop":
            break
        transport, table, _ = served[cmd[1]]
        if cmd[0] == "lease":
            table.add(cmd[2], cmd[3], time.time() + 60)
            replies.put(True)
        elif cmd[0] == "status":
            replies.put({"num_held": table.num_held, **transport.stats()})
    for transport, _, _ in served.values():
        transport.close()


class KVPeer:
    """A KV peer in another process (spawned), driven through queues."""

    def __init__(self, name: str, options: dict[str, Any] | None = None,
                 device: str = "cpu") -> None:
        require_transport(name)
        ctx = mp.get_context("spawn")
        self._cmds, self._replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=kv_peer_main, daemon=True,
                                args=(name, options or {}, device, self._cmds, self._replies))
        self.proc.start()
        self.ports: dict[Any, int] = self._replies.get(timeout=300)

    def lease(self, key: Any, req: str, blocks: list[int]) -> None:
        self._cmds.put(("lease", key, req, blocks))
        assert self._replies.get(timeout=30)

    def status(self, key: Any) -> dict[str, int]:
        self._cmds.put(("status", key))
        return self._replies.get(timeout=30)

    def stop(self) -> None:
        if self.proc.is_alive():
            self._cmds.put(("stop",))
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def pull_main(name: str, port: int, key: tuple[int, str], req: str, src: list[int],
              dst: list[int], timeout_s: float, result: mp.Queue) -> None:
    """A decode-side process pulling once (killed mid-transfer by tests)."""
    block_dim, dtype_name = key
    caches = make_caches(0, getattr(torch, dtype_name), block_dim=block_dim)
    transport, _ = start_transport(name, caches, LeaseTable())
    try:
        nbytes = transport.pull(PeerAddress("127.0.0.1", port), req, src, dst,
                                time.monotonic() + timeout_s)
        result.put(nbytes)
    except TransferError as exc:
        result.put(str(exc))
    transport.close()


def push_kv(seed: int, dtype_name: str, port: int, transfer_id: str,
            pushes: list[tuple[int, int, list[int], bool]], num_blocks: int, checksum: bool,
            done: mp.Queue) -> None:
    """A prefill's side of layer-wise push: send (layer, first position, our block
    ids, final) to the push inbox at ``port``; puts None or the error text."""
    from pdserve.kv_transfer.base import PeerAddress
    from pdserve.kv_transfer.control.wire import TransferError
    from pdserve.kv_transfer.transports.tcp import TcpTransport

    dtype = getattr(torch, dtype_name)
    caches = make_caches(seed, dtype)
    transport = cast(TcpTransport, create_transport("tcp"))
    transport.start(
        kv_caches=list(caches.values()),
        layout=KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16),
        leases=LeaseTable(), compat=compat(dtype), host="127.0.0.1", port=0,
    )
    peer = PeerAddress("127.0.0.1", port)
    try:
        for layer, first, block_ids, final in pushes:
            transport.push(peer, transfer_id, layer, first, block_ids, num_blocks, final,
                           time.monotonic() + 10, checksum)
        done.put(None)
    except TransferError as exc:
        done.put(str(exc))
    finally:
        transport.close()


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path | None = None  # where ``pdserve up`` logs (stderr), if kept
    secret: ClusterSecret | None = None  # the cluster's: direct calls to workers need it
    tls_files: TlsFiles | None = None  # the cluster's certificate, when it runs TLS
    admin_url: str = ""  # the router's admin listener, when the test started one
    # up's scrape targets (name -> /metrics URL), from the line after the endpoint's.
    metrics_targets: dict[str, str] = field(default_factory=dict)
    temp_dir: Path | None = None  # launch_up's (the cluster secret's): gone once it stops
    log_dir: Path | None = None  # every process's log (up's --log-dir, launch_up's choice)

    @property
    def tls(self) -> GrpcTls | None:
        """What a direct gRPC call to a worker presents (None: the cluster is plaintext)."""
        return self.tls_files.load() if self.tls_files is not None else None

    def log_lines(self, *needles: str) -> list[str]:
        """Lines of the cluster's log holding any of ``needles`` (for failure messages)."""
        if self.log_path is None or not self.log_path.exists():
            return []
        text = self.log_path.read_text(errors="replace")
        return [line for line in text.splitlines() if any(n in line for n in needles)]

    def metric(self, name: str, *labels: str) -> float:
        return router_metric(self.base_url.removesuffix("/v1"), name, *labels)

    def workers(self, role: str) -> list[dict[str, Any]]:
        view = HTTP.get(self.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
        return [w for w in view["workers"] if w["role"] == role]

    def load(self, role: str) -> WorkerLoadReport:
        (worker,) = self.workers(role)
        return probe_load(worker["endpoint"], timeout_s=5, secret=self.secret, tls=self.tls)

    def holding(self) -> dict[str, dict[str, float]]:
        """What each worker holds now (for the message of a failed idle wait)."""
        fields = ("num_inflight_reqs", "num_running_reqs", "num_waiting_reqs",
                  "num_pending_transfers", "kv_cache_usage", "kv_leases_held")
        return {role: {f: getattr(self.load(role), f) for f in fields}
                for role in ("prefill", "decode")}

    def idle(self, endpoints: dict[str, str] | None = None) -> bool:
        """Neither worker holds a request, a KV block or a pending transfer. The
        workers are found through the router unless ``endpoints`` (role -> gRPC
        endpoint) name them."""
        def load(role: str) -> WorkerLoadReport:
            if endpoints is None:
                return self.load(role)
            return probe_load(endpoints[role], timeout_s=5, secret=self.secret, tls=self.tls)

        p, d = load("prefill"), load("decode")
        return (p.num_inflight_reqs == d.num_inflight_reqs == d.num_running_reqs == 0
                and p.num_pending_transfers == d.num_pending_transfers == 0
                and p.kv_cache_usage == d.kv_cache_usage == 0.0)


def read_events(lines: Iterator[str], n: int) -> None:
    """Read an SSE stream's lines until ``n`` data events have arrived. Keep a reference
    to ``lines`` while the stream should stay open: httpx closes the response when its
    line iterator is garbage-collected."""
    received = 0
    while received < n:
        if next(lines).startswith("data: "):
            received += 1


@dataclass
class TimedStream:
    """A streamed completion as the client saw it: when the request was sent, and when
    each chunk carrying tokens arrived (``time.monotonic``)."""

    sent: float
    arrivals: list[float]
    num_tokens: int

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def gaps_s(self) -> list[float]:
        """Between two token chunks (the first token's wait excluded)."""
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]


@contextlib.contextmanager
def encoder_frozen_at(transport: Any, block: int) -> Iterator[None]:
    """``transport``'s pool codec (``--kv-compression``) stops before it sends its
    ``block``-th block (1-based) of the next pulls it serves, until the block ends: a
    peer gone silent mid-stream."""
    codec = transport._pool_codec
    real, frozen, encoded = codec.codec, threading.Event(), []

    class Freezing:
        name = real.name

        def encode(self, chunks: Any) -> bytes:
            encoded.append(1)
            if len(encoded) == block:
                frozen.wait(60)  # this block never comes (until the block ends)
            return bytes(real.encode(chunks))

    codec.codec = Freezing()
    try:
        yield
    finally:
        frozen.set()


def stream_timed(base_url: str, body: dict[str, Any], stop_after: int | None = None,
                 timeout_s: float = 300) -> TimedStream:
    """POST ``body`` (a streamed ``/completions`` with ``return_token_ids``) and time
    its token chunks; with ``stop_after``, hang up once that many tokens came (the
    router aborts the rest)."""
    sent = time.monotonic()
    timed = TimedStream(sent, [], 0)
    with httpx.stream("POST", base_url + "/completions", json=body, timeout=timeout_s) as resp:
        assert resp.status_code == 200, resp.read()
        for event in sse_events(resp.iter_lines()):
            assert "error" not in event, event
            ids = token_ids(event)
            if ids:
                timed.arrivals.append(time.monotonic())
                timed.num_tokens += len(ids)
            if stop_after is not None and timed.num_tokens >= stop_after:
                break
    return timed


def router_metric(router_url: str, name: str, *labels: str) -> float:
    """The sum of the router's samples of ``name`` on /metrics that carry every one of
    ``labels`` (``'reason="x"'``; none: every series, e.g. each ``model_name``), 0 while
    none exists. ``KeyError`` if ``name`` is missing and no labels were asked for."""
    total, found = 0.0, False
    for line in HTTP.get(router_url + "/metrics", timeout=5).text.splitlines():
        if not (line.startswith(name + "{") or (not labels and line.startswith(name + " "))):
            continue
        if all(label in line for label in labels):
            total, found = total + float(line.rsplit(" ", 1)[1]), True
    if not found and not labels:
        raise KeyError(name)
    return total


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.25) -> T:
    """Poll ``predicate`` until it returns a truthy value; return the last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value


def exited(procs: dict[str, subprocess.Popen[bytes]], log_dir: Path, tail: int = 15) -> str:
    """``name exited N`` for each process that ended, with the last lines of its log
    (``log_dir/name.log``): what a cluster fixture's assertion says when one died."""
    said = []
    for name, proc in procs.items():
        if proc.poll() is None:
            continue
        log = log_dir / f"{name}.log"
        lines = log.read_text(errors="replace").splitlines()[-tail:] if log.exists() else []
        said.append(f"{name} exited {proc.returncode}" + "".join(f"\n  | {ln}" for ln in lines))
    return "\n".join(said)


def etcd_keys(url: str, prefix: str, client: httpx.Client = HTTP) -> dict[str, bytes]:
    """The keys under ``prefix`` (etcd's JSON gateway, no client library), or {} when
    etcd is unreachable."""
    return gateway_keys(url, prefix, client)


async def wait_until_async(predicate: Callable[[], T], timeout_s: float,
                           interval_s: float = 0.02) -> T:
    """``wait_until`` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        value = predicate()
    return value


def launch_up(args: list[str], env: dict[str, str], timeout_s: float = 600,
              log_path: Path | None = None) -> Server:
    """Start ``pdserve up`` with ``args`` in its own session and wait for its endpoint
    line; stop it with ``stop_up``. Its stderr (every component's log) goes to
    ``log_path`` when given. The cluster's secret is a file of the test's (up's own
    would leave with it), so the test can call workers directly (``Server.secret``).
    Its processes' logs go to ``--log-dir`` (``Server.log_dir``): unless given, a new
    folder beside ``log_path`` (kept with the test's folder), else in launch_up's own,
    gone once it stops; never the user's ``<cache>/logs``, where up keeps them by default."""
    import sys
    import threading

    own_dir = Path(tempfile.mkdtemp(prefix="pdserve-test-"))
    if "--cluster-secret-file" not in args:
        path = write_cluster_secret(own_dir / "cluster-secret")
        args = [*args, "--cluster-secret-file", str(path)]
    if "--log-dir" not in args:
        logs = (Path(tempfile.mkdtemp(prefix="up-logs-", dir=log_path.parent))
                if log_path is not None else own_dir / "logs")
        args = [*args, "--log-dir", str(logs)]
    log_dir = Path(args[args.index("--log-dir") + 1])
    secret = load_cluster_secret(args[args.index("--cluster-secret-file") + 1])
    cert, key, ca = (args[args.index(f) + 1] if f in args else None
                     for f in ("--tls-cert", "--tls-key", "--tls-ca"))
    tls = TlsFiles(cert, key, ca)

    if log_path is not None:
        log_path.write_bytes(b"")  # fresh: spawn appends
    proc = process.spawn([sys.executable, "-m", "pdserve.cli.main", "up", *args],
                         log_path=log_path, base_env=env, pipe_stdout=True)
    _OWN_DIRS[proc.pid] = own_dir
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line.decode(errors="replace"))

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"pdserve up exited with {proc.returncode}"
                                       + _log_tail(log_path)) from None
                continue
            if line.startswith("http://"):
                return Server(line.strip(), proc, log_path, secret,
                              tls_files=tls if tls.enabled else None,
                              metrics_targets=_targets(lines), temp_dir=own_dir,
                              log_dir=log_dir)
        raise TimeoutError(f"pdserve up not ready after {timeout_s}s")
    except BaseException:
        stop_up(proc)
        raise


def _log_tail(log_path: Path | None, num_lines: int = 60) -> str:
    """The last ``num_lines`` of a failed start's log, for its error (CI prints only
    the error: the log is gone with the clone)."""
    if log_path is None or not log_path.exists():
        return ""
    lines = log_path.read_text(errors="replace").splitlines()[-num_lines:]
    return f"; the last {len(lines)} lines of {log_path}:\n" + "\n".join(lines)


def _targets(lines: queue.Queue[str]) -> dict[str, str]:
    """``metrics: router=http://... prefill-0=http://...`` (up prints it right after its
    endpoint line) as name -> URL; {} if the next line is not that."""
    try:
        line = lines.get(timeout=10)
    except queue.Empty:
        return {}
    if not line.startswith("metrics: "):
        return {}
    return dict(item.split("=", 1) for item in line.removeprefix("metrics: ").split())


# The temp directory ``launch_up`` made for each ``pdserve up`` it started (pid -> dir,
# the cluster secret's), removed when the server is stopped or killed.
_OWN_DIRS: dict[int, Path] = {}


def stop_up(proc: subprocess.Popen[bytes]) -> process.StopReport:
    """SIGTERM ``pdserve up``'s group, then SIGKILL what is left of it and every
    descendant (workers in their own sessions, engines) after 40 s; reaped on return,
    the temp directories it leaves removed."""
    return _stop_and_clean(proc, grace_s=40, sig=signal.SIGTERM)


def kill_cluster(proc: subprocess.Popen[bytes]) -> process.StopReport:
    """SIGKILL a server's group (``pdserve up``, ``vllm serve``) and every descendant at
    once; reaped on return, the temp directories it leaves removed. How a fixture ends
    one whose stop no test checks: a graceful stop waits seconds for each engine to shut
    down (``test_up_supervise.py`` checks up's, on simulated workers)."""
    return _stop_and_clean(proc, grace_s=0, sig=signal.SIGKILL)


def _stop_and_clean(proc: subprocess.Popen[bytes], grace_s: float, sig: int
                    ) -> process.StopReport:
    """``process.stop`` on ``proc``, then removes what it leaves in the temp dir: the
    directory ``launch_up`` made for it, and the data directory of the etcd it ran
    (``up --with-etcd`` removes that only when it is not killed first)."""
    leftovers = [*_etcd_data_dirs(proc)]
    if proc.pid in _OWN_DIRS:
        leftovers.append(_OWN_DIRS.pop(proc.pid))
    report = process.stop([proc], grace_s=grace_s, sig=sig)
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    sweep_dead(Path(tempfile.gettempdir()))  # the killed workers' engine folders
    return report


def _etcd_data_dirs(proc: subprocess.Popen[bytes]) -> list[Path]:
    """The ``--data-dir`` of every etcd among ``proc``'s descendants."""
    dirs = []
    with contextlib.suppress(psutil.Error):
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                argv = child.cmdline()
                if argv and Path(argv[0]).name == "etcd" and "--data-dir" in argv:
                    dirs.append(Path(argv[argv.index("--data-dir") + 1]))
    return dirs


COMPOSE_FILE = Path(__file__).resolve().parents[1] / "deploy" / "compose" / "docker-compose.yml"


def compose_services(path: Path = COMPOSE_FILE) -> dict[str, dict[str, Any]]:
    """deploy/compose's services as compose reads them (YAML anchors and ``<<`` merges
    resolved); environment values as strings, ``${VAR:-default}`` interpolated from this
    process's environment as compose does."""
    import yaml

    services: dict[str, dict[str, Any]] = yaml.safe_load(path.read_text())["services"]
    for service in services.values():
        env = service.get("environment") or {}
        service["environment"] = {k: _interpolate(str(v)) for k, v in env.items()}
    return services


_DEFAULTED = re.compile(r"\$\{(\w+):-([^}]*)\}")


def _interpolate(value: str) -> str:
    return _DEFAULTED.sub(lambda m: os.environ.get(m[1]) or m[2], value)


# PromQL words that look like metric names: keywords, and what ``by (...)`` etc. hold.
_PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right",
                           "bool", "offset", "and", "or", "unless", "inf", "nan"})
_STRIP = (re.compile(r'"(?:[^"\\]|\\.)*"'),  # string literals (label values)
          re.compile(r"\{[^}]*\}"),  # label matchers
          re.compile(r"\[[^\]]*\]"),  # ranges
          re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"))
_NAME = re.compile(r"(?<![\w:$.])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:]|\s*\()")


def dashboard_exprs(path: str | Path) -> list[str]:
    """Every query (``targets[].expr``) of a Grafana dashboard JSON, rows' panels included."""
    dashboard = json.loads(Path(path).read_text())
    exprs: list[str] = []

    def walk(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            exprs.extend(t["expr"] for t in panel.get("targets", []) if t.get("expr"))
            walk(panel.get("panels", []))

    walk(dashboard.get("panels", []))
    return exprs


def dashboard_metric_names(path: str | Path) -> set[str]:
    """The exposition names a scrape must contain for the dashboard's queries to have
    data: ``histogram_quantile(0.5, rate(pdserve:x_bucket[5m]))`` -> ``pdserve:x_bucket``
    (functions, keywords, label names and values left out)."""
    names: set[str] = set()
    for expr in dashboard_exprs(path):
        for pattern in _STRIP:
            expr = pattern.sub(" ", expr)
        names.update(n for n in _NAME.findall(expr) if n.lower() not in _PROMQL_WORDS)
    return names


def router_child(server: Server) -> psutil.Process:
    """The router process of a ``pdserve up`` (to start a second one as it was started)."""
    for p in psutil.Process(server.proc.pid).children():
        try:
            if p.cmdline()[3:4] == ["router"]:
                return p
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("the cluster has no router process")


def with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value replaced (or the flag added)."""
    if flag not in argv:
        return [*argv, flag, value]
    i = argv.index(flag) + 1
    return [*argv[:i], value, *argv[i + 1:]]
