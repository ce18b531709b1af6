"""The systems ``stream.py`` measures, each started and stopped with ``ProcGroup``:
``pdserve router --processes N`` in front of two sim workers (decode paced at
``--ms-per-token``), and ``vllm-router`` (vLLM's P/D router, ``--vllm-pd-disaggregation``)
in front of two ``openai_stub`` engines with the same pacing. Each comes with its direct
path: the calls the router makes for a request's first token, made from here."""

from __future__ import annotations

import contextlib
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx

from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.bench.micro.router_cost.stream_client import (
    MODEL,
    CpuMeter,
    StreamResult,
    exchange,
    post_bytes,
    request_bytes,
    stream,
)
from pdserve.core import process
from pdserve.core.ports import free_port
from pdserve.core.types import PhaseRequest, SamplingSpec
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient

PY = (sys.executable, "-m", "pdserve.cli.main")
READY_TIMEOUT_S = 180.0
CALL_TIMEOUT_S = 30.0
MAX_REQUESTS = 8192  # admission never queues what the bench sends
VLLM_PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False,
                   "remote_engine_id": None, "remote_block_ids": None,
                   "remote_host": None, "remote_port": None}


class DirectPath(Protocol):
    """A stream straight from the engines, the calls the router would make, stamped as
    ``stream_client.stream`` stamps one through the router. Made and used on one event
    loop; ``close`` on it too."""

    async def stream(self, max_tokens: int, result: StreamResult) -> None: ...

    async def close(self) -> None: ...


class PdserveDirect:
    """The router's gRPC calls for one request: prefill (its output is the first token)
    and then decode of the rest with the KV handle."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.endpoints = (prefill, decode)
        self.clients: tuple[WorkerClient, WorkerClient] | None = None
        self.num_calls = 0

    async def stream(self, max_tokens: int, result: StreamResult) -> None:
        if self.clients is None:
            self.clients = (WorkerClient(self.endpoints[0]), WorkerClient(self.endpoints[1]))
            await self.stream(2, StreamResult(time.perf_counter()))  # connect the channels
            result.start = time.perf_counter()
        p, d = self.clients
        self.num_calls += 1
        prompt, rid = tuple(range(10, 50)), f"direct-{self.num_calls}"
        spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        try:
            first = [o async for o in p.generate(PhaseRequest(rid, "prefill", prompt, spec),
                                                 CALL_TIMEOUT_S)]
            result.stamps.append(time.perf_counter())
            request = PhaseRequest(rid, "decode", (*prompt, *first[-1].token_ids),
                                   SamplingSpec(max_tokens - 1, 0.0, ignore_eos=True),
                                   kv_handle=first[-1].kv_handle)
            async for out in d.generate(request, CALL_TIMEOUT_S):
                result.stamps.extend([time.perf_counter()] * len(out.token_ids))
            result.ok = True
        except WorkerCallError:
            pass
        result.ended = True

    async def close(self) -> None:
        if self.clients is not None:
            await self.clients[0].close()
            await self.clients[1].close()


@dataclass(frozen=True)
class VllmDirect:
    """vllm-router's HTTP calls for one request: prefill (one token, not streamed, KV
    kept), then the streamed decode."""

    prefill_port: int
    decode_port: int

    async def stream(self, max_tokens: int, result: StreamResult) -> None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 1,
                "kv_transfer_params": VLLM_PREFILL_KV}
        try:
            await exchange(self.prefill_port, post_bytes(
                self.prefill_port, "/v1/completions", body), CALL_TIMEOUT_S)
        except (OSError, TimeoutError):
            result.ended = True
            return
        await stream(self.decode_port, request_bytes(self.decode_port, max_tokens),
                     CALL_TIMEOUT_S, result)

    async def close(self) -> None:
        return None


@dataclass(frozen=True)
class System:
    """A started router under test: its port, its process tree (``router_pid`` and all
    its descendants), its engines' processes, its direct path and process count."""

    name: str
    port: int
    router_pid: int
    engine_pids: tuple[int, ...]
    direct: DirectPath
    num_processes: int

    def meter(self) -> CpuMeter:
        """CPU of the router's tree, the engines' and this process's (the client)."""
        return CpuMeter({"router": (self.router_pid,), "engines": self.engine_pids})


def free_port_run(n: int) -> int:
    """The first of ``n`` consecutive free ports."""
    for _ in range(50):
        base = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(base, base + n):
                    s = stack.enter_context(socket.socket())
                    s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return base
    raise RuntimeError(f"no {n} consecutive free ports")


def sims(log_dir: Path, ms_per_token: float, lockstep: bool = False
         ) -> tuple[list[Proc], str, str]:
    """A sim prefill and a sim decode paced at ``ms_per_token``; ``lockstep``: the
    decode's running requests step together (a real engine's batch), else each on its
    own timer."""
    ports = {role: free_port() for role in ("prefill", "decode")}
    step = ["--decode-lockstep"] if lockstep else []
    procs = [Proc(f"sim-{role}", (*PY, "sim-worker", "--role", role, "--port", str(port),
                                  "--prefill-us-per-token", "0", "--decode-ms-per-token",
                                  str(ms_per_token if role == "decode" else 0),
                                  *(step if role == "decode" else []),
                                  "--log-level", "WARNING"),
                  log_dir / f"sim-{role}.log", f"grpc:127.0.0.1:{port}")
             for role, port in ports.items()]
    return procs, f"127.0.0.1:{ports['prefill']}", f"127.0.0.1:{ports['decode']}"


def _all_admin_ready(admin: int, n: int) -> str:
    for i in range(n):
        try:
            status = httpx.get(f"http://127.0.0.1:{admin + i}/health", timeout=1).status_code
        except httpx.HTTPError:
            return f"router process {i}: no answer"
        if status != 200:
            return f"router process {i}: HTTP {status}"
    return ""


@contextlib.contextmanager
def pdserve_router(n: int, prefill: str, decode: str, engine_pids: tuple[int, ...],
                   log_dir: Path) -> Iterator[System]:
    """``pdserve router --processes n`` in front of the sims; ready when every process's
    admin ``/health`` answers."""
    port, admin = free_port(), free_port_run(n)
    router = Proc("router", (*PY, "router", "--port", str(port), "--prefill", prefill,
                             "--decode", decode, "--disagg", "always", "--processes", str(n),
                             "--admin-port", str(admin), "--max-concurrent-requests",
                             str(MAX_REQUESTS), "--max-queued-requests", str(MAX_REQUESTS),
                             "--log-level", "WARNING"),
                  log_dir / f"router-{n}.log", f"http://127.0.0.1:{port}/health")
    with ProcGroup([router]) as group:
        group.wait_ready(READY_TIMEOUT_S)
        process.wait_ready(lambda: _all_admin_ready(admin, n), READY_TIMEOUT_S)
        yield System(f"pdserve N={n}", port, group.pid("router"), engine_pids,
                      PdserveDirect(prefill, decode), n)


@contextlib.contextmanager
def vllm_router(log_dir: Path, ms_per_token: float) -> Iterator[System]:
    """Two ``openai_stub`` engines (prefill: 2 ms per answer; decode: paced) and
    ``vllm-router --vllm-pd-disaggregation`` in front of them."""
    p_port, d_port, port, prom = (free_port() for _ in range(4))
    stub = (sys.executable, "-m", "pdserve.bench.micro.router_cost.openai_stub")
    engines = [Proc(f"stub-{role}", (*stub, "--port", str(eport), "--ms-per-token", str(ms)),
                    log_dir / f"stub-{role}.log", f"http://127.0.0.1:{eport}/health")
               for role, eport, ms in (("prefill", p_port, 0), ("decode", d_port, ms_per_token))]
    router = Proc("vllm-router", (sys.executable, "-m", "vllm_router.launch_router",
                                  "--vllm-pd-disaggregation",
                                  "--prefill", f"http://127.0.0.1:{p_port}",
                                  "--decode", f"http://127.0.0.1:{d_port}",
                                  "--policy", "round_robin", "--host", "127.0.0.1",
                                  "--port", str(port), "--prometheus-port", str(prom),
                                  "--max-concurrent-requests", str(MAX_REQUESTS),
                                  "--queue-size", str(MAX_REQUESTS), "--log-level", "warning"),
                  log_dir / "vllm-router.log", f"http://127.0.0.1:{port}/health")
    with ProcGroup([*engines, router]) as group:
        group.wait_ready(READY_TIMEOUT_S)
        yield System("vllm-router", port, group.pid("vllm-router"),
                      tuple(group.pid(p.name) for p in engines),
                      VllmDirect(p_port, d_port), 1)
