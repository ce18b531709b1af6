"""Helpers shared by the test suites (importable from spawned processes too)."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import httpx
import torch
from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions, create_transport
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.wire import TransferError
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc

T = TypeVar("T")

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


def start_transport(name: str, caches: dict[str, torch.Tensor], leases: LeaseTable,
                    options: TransportOptions | None = None) -> tuple[KVTransport, int]:
    """A transport over ``caches``, serving on 127.0.0.1, as the worker side starts it."""
    dtype = next(iter(caches.values())).dtype
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16)
    transport = create_transport(name, options)
    port = transport.start(kv_caches=list(caches.values()), layout=layout, leases=leases,
                           compat=dict(compat(dtype), layout=layout.describe()),
                           host="127.0.0.1", port=0)
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
                 replies: mp.Queue) -> None:  # type: ignore[type-arg]
    """A process serving every KV set in ``KV_KEYS`` over transport ``name``, plus
    ``CORRUPT_KEY``: the (0, float32) set from a sender that corrupts its sends.

    Commands: ("lease", key, req, blocks) | ("status", key) | ("stop",).
    """
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    served: dict[Any, tuple[KVTransport, LeaseTable, int]] = {}
    for key in [*KV_KEYS, CORRUPT_KEY]:
        block_dim, dtype_name = key[:2]
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
              dst: list[int], timeout_s: float, result: mp.Queue) -> None:  # type: ignore[type-arg]
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


@dataclass
class Server:
    base_url: str
    proc: subprocess.Popen[str]

    def workers(self, role: str) -> list[dict[str, Any]]:
        view = httpx.get(self.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
        return [w for w in view["workers"] if w["role"] == role]

    def load(self, role: str) -> pb.GetLoadResponse:
        (worker,) = self.workers(role)
        with grpc.insecure_channel(worker["endpoint"]) as channel:
            return pb_grpc.WorkerServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=5)


def wait_until(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.25) -> T:
    """Poll ``predicate`` until it returns a truthy value; return the last value."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        time.sleep(interval_s)
        value = predicate()
    return value
