"""What the router adds per request and per streamed chunk, and the rate one router
process sustains. No vLLM: two simulated workers (``pdserve sim-worker``, 1 prefill + 1
decode, no modelled compute) and one router, each a process of its own.

  (a) added latency per request: streamed ``/v1/completions`` (``max_tokens`` 2: one
      prefill call, one decode call) through the router vs the same two gRPC calls made
      straight to the sim workers from this script; p50/p99 of both and of the difference.
  (b) added cost per chunk: the mean gap between streamed chunks of long outputs, through
      the router vs direct; and the router's CPU time per chunk (long minus short
      requests), which other processes on a shared machine cannot inflate.
  (c) closed loop: ``--clients`` concurrent clients for ``--duration-s``: req/s and the
      router process's CPU %.

Prints ratios against the targets (added p50 <= 1 ms per request, <= 50 us per chunk).
``--auth none secret`` runs (a)-(c) once per entry, in order (repeat entries to interleave),
without and with a cluster secret on every process (signed calls, worker proofs:
``pdserve.core.grpc_auth``), and prints the router's CPU per request and per chunk of
each beside the other (medians over a mode's runs).
Those are ``--parts latency`` (the default); ``--parts stream`` measures the router's CPU
per streamed token with engines that pace their tokens, the rate one process sustains
per process count, and vLLM's ``vllm-router`` beside it (``stream.py``);
``--parts replicas`` the prefix hit rate through two routers active-active against one
(``replicas.py``).

    pdserve bench router-cost            # --requests 300 --clients 16
    pdserve bench router-cost --parts latency stream
    pdserve bench router-cost --auth none secret none secret --requests 200
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypedDict

import httpx
import psutil

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.bench.micro.router_cost.auth import run_auth
from pdserve.bench.micro.router_cost.replicas import run_replicas
from pdserve.bench.micro.router_cost.stream import run_stream
from pdserve.bench.micro.router_cost.stream_report import report as stream_report
from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret, load_cluster_secret, write_cluster_secret
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port
from pdserve.core.types import PhaseRequest, SamplingSpec
from pdserve.router.dispatch.workers.client import WorkerClient

PROMPT_TEXT = "The quick brown fox jumps over the lazy dog. " * 4
TARGET_REQUEST_S = 1e-3
TARGET_CHUNK_S = 50e-6


class Measured(TypedDict):
    """``measure``'s result: each request's stamps (``direct``, ``via_router``) both ways,
    and the router's CPU seconds per request while it served them."""
    direct: list[list[float]]
    router: list[list[float]]
    router_cpu_s_per_request: float


def sim_worker(role: str, port: int, log_dir: Path, secret_file: str | None = None) -> Proc:
    """A sim worker with no modelled compute (needing the cluster secret in ``secret_file``)."""
    auth = ("--cluster-secret-file", secret_file) if secret_file else ()
    return Proc(role, (sys.executable, "-m", "pdserve.cli.main", "sim-worker", "--role", role,
                       "--port", str(port), "--prefill-us-per-token", "0",
                       "--decode-ms-per-token", "0", "--log-level", "WARNING", *auth),
                log_dir / f"{role}.log", f"grpc:127.0.0.1:{port}",
                secret=load_cluster_secret(secret_file) if secret_file else None)


def children(log_dir: Path, secret_file: str | None = None
             ) -> tuple[list[Proc], str, str, str]:
    """Sim prefill + sim decode (no modelled compute) + a router in front of them."""
    py = (sys.executable, "-m", "pdserve.cli.main")
    ports = {name: free_port() for name in ("prefill", "decode", "router")}
    sims = [sim_worker(role, ports[role], log_dir, secret_file) for role in ("prefill", "decode")]
    p, d = (f"127.0.0.1:{ports[r]}" for r in ("prefill", "decode"))
    url = f"http://127.0.0.1:{ports['router']}"
    auth = ("--cluster-secret-file", secret_file) if secret_file else ()
    router = Proc("router", (*py, "router", "--port", str(ports["router"]), "--prefill", p,
                             "--decode", d, "--log-level", "WARNING", *auth),
                  log_dir / "router.log", f"{url}/health")
    return [*sims, router], url, p, d


async def via_router(http: httpx.AsyncClient, max_tokens: int) -> list[float]:
    """One streamed request; the perf_counter time of its start and of each data event."""
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT_TEXT, "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    stamps = [time.perf_counter()]
    async with http.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
    return stamps


async def direct(p: WorkerClient, d: WorkerClient, prompt: tuple[int, ...], max_tokens: int,
                 n: int) -> list[float]:
    """What the router does, minus the router: prefill, then decode with its handle."""
    spec = SamplingSpec(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    stamps = [time.perf_counter()]
    first = [o async for o in p.generate(PhaseRequest(f"b{n}", "prefill", prompt, spec), 10)]
    stamps.append(time.perf_counter())
    request = PhaseRequest(f"b{n}", "decode", (*prompt, *first[-1].token_ids),
                           SamplingSpec(max_tokens - 1, 0.0, ignore_eos=True),
                           kv_handle=first[-1].kv_handle)
    async for _ in d.generate(request, 10):
        stamps.append(time.perf_counter())
    return stamps


async def sequential(run: Callable[[int], Awaitable[list[float]]], n: int) -> list[list[float]]:
    await run(-1)  # warm up connections
    return [await run(i) for i in range(n)]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def gaps(runs: list[list[float]]) -> list[float]:
    """Mean gap between consecutive chunks after the first, per request."""
    return [(s[-1] - s[2]) / (len(s) - 3) for s in runs if len(s) > 3]


def cpu_s(pid: int) -> float:
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


async def measure(http: httpx.AsyncClient, p: WorkerClient, d: WorkerClient, pid: int,
                  max_tokens: int, n: int) -> Measured:
    """``n`` sequential requests each way; the router's CPU per request while it served."""
    prompt = tuple(range(10, 10 + 40))
    direct_runs = await sequential(lambda i: direct(p, d, prompt, max_tokens, i), n)
    before = cpu_s(pid)
    router_runs = await sequential(lambda i: via_router(http, max_tokens), n)
    cpu = (cpu_s(pid) - before) / (n + 1)
    return {"direct": direct_runs, "router": router_runs, "router_cpu_s_per_request": cpu}


async def closed_loop(url: str, pid: int, clients: int, duration_s: float, max_tokens: int
                      ) -> dict[str, float]:
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=30) as http:
        done = 0
        deadline = time.perf_counter() + duration_s

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await via_router(http, max_tokens)
                done += 1

        await asyncio.gather(*(via_router(http, 2) for _ in range(clients)))  # warm up
        cpu0, t0 = cpu_s(pid), time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        wall = time.perf_counter() - t0
        return {"req_per_s": done / wall, "router_cpu_pct": 100 * (cpu_s(pid) - cpu0) / wall}


def summarize(short: Measured, long: Measured, long_tokens: int) -> dict[str, float]:
    r_e2e = [s[-1] - s[0] for s in short["router"]]
    d_e2e = [s[-1] - s[0] for s in short["direct"]]
    r_gap = statistics.median(gaps(long["router"]))
    d_gap = statistics.median(gaps(long["direct"]))
    cpu_short = short["router_cpu_s_per_request"]
    cpu_long = long["router_cpu_s_per_request"]
    return {
        "router_e2e_p50_ms": 1e3 * pct(r_e2e, 0.5), "router_e2e_p99_ms": 1e3 * pct(r_e2e, 0.99),
        "direct_e2e_p50_ms": 1e3 * pct(d_e2e, 0.5), "direct_e2e_p99_ms": 1e3 * pct(d_e2e, 0.99),
        "added_p50_ms": 1e3 * (pct(r_e2e, 0.5) - pct(d_e2e, 0.5)),
        "added_p99_ms": 1e3 * (pct(r_e2e, 0.99) - pct(d_e2e, 0.99)),
        "router_cpu_ms_per_request": 1e3 * cpu_short,
        "chunk_gap_router_us": 1e6 * r_gap, "chunk_gap_direct_us": 1e6 * d_gap,
        "added_per_chunk_us": 1e6 * (r_gap - d_gap),
        "router_cpu_us_per_chunk": 1e6 * (cpu_long - cpu_short) / (long_tokens - 2),
    }


def report(s: dict[str, float], loop: dict[str, float]) -> None:
    for key, value in {**s, **loop}.items():
        print(f"  {key:28s} {value:10.3f}")
    print(f"added p50 per request: {s['added_p50_ms']:.3f} ms = "
          f"{s['added_p50_ms'] / (TARGET_REQUEST_S * 1e3):.2f}x the 1 ms target")
    for key in ("added_per_chunk_us", "router_cpu_us_per_chunk"):
        print(f"{key}: {s[key]:.1f} us = {s[key] / (TARGET_CHUNK_S * 1e6):.2f}x the 50 us target")


def profiler(pid: int, out: str | None, duration_s: float, log_dir: Path
             ) -> subprocess.Popen[bytes] | None:
    """py-spy (beside this interpreter) sampling the router while the closed loop runs."""
    if out is None:
        return None
    spy = Path(sys.executable).parent / "py-spy"
    return process.spawn([str(spy), "record", "--pid", str(pid), "--format", "raw",
                          "--duration", str(int(duration_s)), "--rate", "200", "-o", out,
                          "--nonblocking"], log_path=log_dir / "py-spy.log")


async def measure_all(cfg: RouterCostConfig, url: str, p_ep: str, d_ep: str, pid: int,
                      log_dir: Path, secret: ClusterSecret | None = None) -> dict[str, float]:
    p, d = WorkerClient(p_ep, secret), WorkerClient(d_ep, secret)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            short = await measure(http, p, d, pid, 2, cfg.requests)
            long = await measure(http, p, d, pid, cfg.long_tokens, cfg.long_requests)
        spy = profiler(pid, cfg.profile, cfg.duration_s, log_dir)
        try:
            loop = await closed_loop(url, pid, cfg.clients, cfg.duration_s, cfg.loop_tokens)
            if spy is not None:
                await asyncio.to_thread(spy.wait, cfg.duration_s + 60)
        finally:
            if spy is not None:
                process.stop([spy], grace_s=5)
    finally:
        await asyncio.gather(p.close(), d.close())
    summary = summarize(short, long, cfg.long_tokens)
    report(summary, loop)
    return {**summary, **loop}


@contextlib.contextmanager
def secret_file_for(auth: str) -> Iterator[str | None]:
    """``auth`` "secret": a new cluster secret's file, removed on exit (it lives only
    while the processes that read it do, never beside the logs a run keeps); else None."""
    if auth != "secret":
        yield None
        return
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-secret-") as keys:
        yield str(write_cluster_secret(Path(keys) / "secret"))


def run_latency(cfg: RouterCostConfig, auth: str = "none") -> dict[str, float]:
    """(a)-(c) against their own sims and router; ``auth`` "secret": a cluster secret on
    every process and on this script's own calls."""
    log_dir = new_log_dir(f"bench-router-cost-{auth}-")
    print(f"-- auth: {auth} (logs in {log_dir})")
    with secret_file_for(auth) as secret_file:
        procs, url, p_ep, d_ep = children(log_dir, secret_file)
        with ProcGroup(procs) as group:
            group.wait_ready(120)
            return asyncio.run(measure_all(cfg, url, p_ep, d_ep, group.pid("router"),
                                           log_dir, load_cluster_secret(secret_file)
                                           if secret_file else None))


def run(cfg: RouterCostConfig) -> int:
    numbers: dict[str, object] = {}
    if "latency" in cfg.parts:
        numbers.update(run_auth(cfg, run_latency))
    if "stream" in cfg.parts:
        numbers["stream"] = stream_report(cfg, run_stream(cfg))
    if "replicas" in cfg.parts:
        numbers["replicas"] = run_replicas(cfg)
    if cfg.json:
        Path(cfg.json).write_text(json.dumps(numbers, indent=2))
    return 0
