"""Helpers shared by the test suites (importable from spawned processes too)."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import httpx
import torch
from pdserve.kv_transfer.base import create_transport
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc

T = TypeVar("T")

NUM_BLOCKS = 16
LAYER_SHAPE = (NUM_BLOCKS, 3, 16, 128)  # the CPU backend's (blocks, heads, block, 2*head_dim)


def make_caches(seed: int, dtype: torch.dtype, num_layers: int = 4) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn((num_layers, *LAYER_SHAPE), generator=gen).to(dtype)
    return {f"layer.{i}": buf[i] for i in range(num_layers)}  # views of one buffer, like vLLM


def compat(dtype: torch.dtype) -> dict[str, object]:
    return {"model": "m", "dtype": str(dtype), "block_size": 16, "tp_size": 1}


def serve_kv(seed: int, dtype_name: str, leases: dict[str, list[int]], ready: mp.Queue,
          stop: mp.Event) -> None:  # type: ignore[valid-type]
    dtype = getattr(torch, dtype_name)
    caches = make_caches(seed, dtype)
    table = LeaseTable()
    for req, blocks in leases.items():
        table.add(req, blocks, time.time() + 30)
    transport = create_transport("tcp")
    port = transport.start(
        kv_caches=list(caches.values()),
        layout=KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16),
        leases=table, compat=compat(dtype), host="127.0.0.1", port=0,
    )
    ready.put(port)
    stop.wait(60)
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


async def wait_until_async(predicate: Callable[[], T], timeout_s: float,
                           interval_s: float = 0.02) -> T:
    """``wait_until`` for coroutines: polls without blocking the event loop."""
    deadline = time.monotonic() + timeout_s
    value = predicate()
    while not value and time.monotonic() < deadline:
        await asyncio.sleep(interval_s)
        value = predicate()
    return value


def launch_up(args: list[str], env: dict[str, str], timeout_s: float = 600) -> Server:
    """Start ``pdserve up`` with ``args`` in its own session and wait for its endpoint
    line; stop it with ``stop_up``."""
    import queue
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env, start_new_session=True)
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(f"pdserve up exited with {proc.returncode}") from None
                continue
            if line.startswith("http://"):
                return Server(line.strip(), proc)
        raise TimeoutError(f"pdserve up not ready after {timeout_s}s")
    except BaseException:
        stop_up(proc)
        raise


def stop_up(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL the whole process group (engines included)."""
    import os
    import signal

    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
