"""``pdserve bench router-cost --parts stream``: what the router costs per streamed token
when the engines pace their tokens as real ones do, and the token rate one router
process sustains; beside it, vLLM's ``vllm-router`` in front of minimal engines with the
same pacing. Every number comes from this one run.

  paced  ``--streams`` K streams at once, of 2 tokens (``--short-rounds`` times) and then
         of ``--stream-tokens`` T tokens, the decode engine at ``--ms-per-token``. The
         router's CPU (its whole process tree, less its idle rate) over both passes
         gives CPU per token and per request (two equations, two unknowns); the long
         pass gives TTFT and ITL p50/p99 and the largest gap, from client stamps. Added
         TTFT: lone requests through the router minus the same calls made straight to
         the engines (p50 of each).
  sweep  per ``--processes-list`` N: K clients (``--sweep-streams``, rising) each
         streaming ``--sweep-tokens``-token requests back to back, their starts spread
         over one request; over ``--sweep-window-s`` of steady state: the token rate,
         ITL p99 and everyone's CPU. It stops at the first K whose ITL p99 exceeds
         ``PACING_SLACK`` x the engines' own, that fails a request, or that fills the
         router's cores or the client's; the highest passing rate is N's. A step whose
         engines lost their own pacing (ITL p99 > ``BUSY`` x the pacing) is busy:
         passed over, and two in a row end the sweep.

The engines' own ITL p99 is that of ``--probe-streams`` streams made straight to them
(the router's calls, from this process) beside the routed ones, at least the pacing: on
a machine whose cores are shared, late wake-ups stretch every gap, the router's or not.
The client (``stream_client``) and the engines share the cores with the router; their
CPU is reported beside it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.bench.micro.procs import ProcGroup
from pdserve.bench.micro.router_cost.stream_client import (
    CpuMeter,
    StreamResult,
    pct,
    per_token_and_request,
    request_bytes,
    stream,
    stream_stats,
)
from pdserve.bench.micro.router_cost.stream_systems import (
    READY_TIMEOUT_S,
    System,
    pdserve_router,
    sims,
    vllm_router,
)
from pdserve.core.model import new_log_dir

PACING_SLACK = 1.1  # ITL p99 may exceed the engines' own by 10 %
BUSY = 1.5  # engines' own ITL p99 beyond BUSY x the pacing: the cores are too busy to tell
SATURATED = 0.95  # the share of its cores at which the router counts as full
CLIENT_SATURATED = 0.9  # of one core: the client's own loop lags beyond
IDLE_S = 2.0
STREAM_TIMEOUT_S = 60.0
WARM_STREAMS = 8

Send = Callable[[StreamResult], Awaitable[object]]


def routed(system: System, max_tokens: int) -> Send:
    """One stream through the router into the given result."""
    request = request_bytes(system.port, max_tokens)
    return lambda result: stream(system.port, request, STREAM_TIMEOUT_S, result)


def direct(system: System, max_tokens: int) -> Send:
    """One stream straight from the engines into the given result."""
    return lambda result: system.direct.stream(max_tokens, result)


async def once(send: Send, n: int) -> list[StreamResult]:
    """``n`` streams at once."""
    results = [StreamResult(time.perf_counter()) for _ in range(n)]
    await asyncio.gather(*(send(r) for r in results))
    return results


async def idle_rates(meter: CpuMeter, seconds: float = IDLE_S) -> dict[str, float]:
    """CPU seconds per second of each group while nothing is sent."""
    before = meter.read()
    await asyncio.sleep(seconds)
    return {k: v / seconds for k, v in CpuMeter.delta(before, meter.read()).items()}


async def measured(meter: CpuMeter, idle: dict[str, float], work: Awaitable[object]
                   ) -> tuple[dict[str, float], float]:
    """Each group's CPU seconds during ``work`` less its idle rate, and the wall."""
    before, t0 = meter.read(), time.perf_counter()
    await work
    wall = time.perf_counter() - t0
    cpu = CpuMeter.delta(before, meter.read())
    return {k: v - idle[k] * wall for k, v in cpu.items()}, wall


async def lone_ttft(system: System, n: int) -> tuple[float, float]:
    """p50 TTFT of ``n`` lone streams through the router, and of ``n`` direct ones."""
    ttfts = []
    for send in (routed(system, 2), direct(system, 2)):
        runs = [(await once(send, 1))[0].ttft for _ in range(n)]
        ttfts.append(pct([t for t in runs if t is not None], 0.5))
    return ttfts[0], ttfts[1]


async def paced(system: System, cfg: RouterCostConfig) -> dict[str, float]:
    """The paced passes: CPU per token and per request, TTFT, ITL (see the module doc)."""
    k, meter = cfg.streams, system.meter()
    await once(routed(system, 4), WARM_STREAMS)
    idle = await idle_rates(meter)
    routed_ttft, direct_ttft = await lone_ttft(system, cfg.lone_requests)
    short: list[StreamResult] = []

    async def short_rounds() -> None:
        for _ in range(cfg.short_rounds):
            short.extend(await once(routed(system, 2), k))

    s_cpu, _ = await measured(meter, idle, short_rounds())
    long = asyncio.ensure_future(once(routed(system, cfg.stream_tokens), k))
    probes = asyncio.ensure_future(once(direct(system, cfg.stream_tokens), cfg.probe_streams))
    l_cpu, wall = await measured(meter, idle, asyncio.gather(long, probes))
    s_tok, l_tok = (sum(len(r.stamps) for r in res) for res in (short, long.result()))
    per_token, per_request = per_token_and_request(
        (s_cpu["router"], s_tok, len(short)), (l_cpu["router"], l_tok, k))
    own = stream_stats(probes.result())
    return {**stream_stats(long.result()),
            "num_failed": float(sum(not r.ok for r in short + long.result())),
            "events_per_stream": l_tok / k, "direct_itl_p50_ms": own["itl_p50_ms"],
            "direct_itl_p99_ms": own["itl_p99_ms"],
            "router_cpu_us_per_token": 1e6 * per_token,
            "router_cpu_ms_per_request": 1e3 * per_request,
            "router_idle_cpu_pct": 100 * idle["router"],
            "lone_ttft_p50_ms": 1e3 * routed_ttft, "direct_ttft_p50_ms": 1e3 * direct_ttft,
            "added_ttft_p50_ms": 1e3 * (routed_ttft - direct_ttft),
            "tokens_per_s": l_tok / wall,
            **{f"{g}_cpu_pct": 100 * (c + idle[g] * wall) / wall for g, c in l_cpu.items()}}


def clients(send: Send, k: int, span: float, until: float, results: list[StreamResult]
            ) -> list[asyncio.Future[None]]:
    """``k`` clients sending back to back until ``until``, their starts spread over
    ``span``; each stream's result joins ``results`` as it starts."""

    async def client(i: int) -> None:
        await asyncio.sleep(i * span / k)
        while time.perf_counter() < until:
            result = StreamResult(time.perf_counter())
            results.append(result)
            await send(result)

    return [asyncio.ensure_future(client(i)) for i in range(k)]


async def sustain(system: System, k: int, cfg: RouterCostConfig) -> dict[str, float]:
    """K routed clients (and ``--probe-streams`` direct ones) streaming back to back;
    the steady window's rate, ITL (routed and direct) and CPU."""
    span = cfg.sweep_tokens * cfg.ms_per_token / 1e3  # one request: the starts spread
    lo = time.perf_counter() + span
    hi = lo + cfg.sweep_window_s
    results: list[StreamResult] = []
    probes: list[StreamResult] = []
    tasks = [*clients(routed(system, cfg.sweep_tokens), k, span, hi, results),
             *clients(direct(system, cfg.sweep_tokens), cfg.probe_streams, span, hi, probes)]
    meter = system.meter()
    try:
        await asyncio.sleep(lo - time.perf_counter())
        before = meter.read()
        await asyncio.sleep(hi - time.perf_counter())
        cpu = CpuMeter.delta(before, meter.read())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    events = sum(lo <= s <= hi for r in results for s in r.stamps)
    cores = min(system.num_processes, os.cpu_count() or 1)
    return {"streams": float(k), **stream_stats(results, lo, hi),
            "direct_itl_p99_ms": stream_stats(probes, lo, hi)["itl_p99_ms"],
            "num_failed": float(sum(r.ended and not r.ok for r in results)),
            "tokens_per_s": events / cfg.sweep_window_s,
            **{f"{g}_cpu_pct": 100 * c / cfg.sweep_window_s for g, c in cpu.items()},
            "router_saturated": float(cpu["router"] / cfg.sweep_window_s
                                      >= SATURATED * cores)}


def itl_limit_ms(step: dict[str, float], cfg: RouterCostConfig) -> float:
    """``PACING_SLACK`` x the engines' own ITL p99 (the direct streams', at least the
    pacing): what the routed ITL p99 may reach."""
    own = step["direct_itl_p99_ms"]
    return PACING_SLACK * max(cfg.ms_per_token, own if own == own else 0.0)


def verdict(step: dict[str, float], cfg: RouterCostConfig) -> str:
    """'' if the step kept the pacing, else what stopped it (``busy``: the engines' own
    streams lost their pacing too, so the step says nothing about the router)."""
    if step["num_failed"]:
        return f"{step['num_failed']:.0f} failed"
    own = step["direct_itl_p99_ms"]
    if not own <= BUSY * cfg.ms_per_token:
        return f"busy: the engines' own ITL p99 is {own:.1f} ms"
    if not step["itl_p99_ms"] <= itl_limit_ms(step, cfg):
        return f"ITL p99 {step['itl_p99_ms']:.1f} > {itl_limit_ms(step, cfg):.1f} ms"
    if step["router_saturated"]:
        return f"router CPU {step['router_cpu_pct']:.0f} %"
    if step["client_cpu_pct"] >= 100 * CLIENT_SATURATED:
        return f"client CPU {step['client_cpu_pct']:.0f} %"
    return ""


async def step_at(system: System, k: int, cfg: RouterCostConfig) -> tuple[dict[str, float], str]:
    """One sweep step, and what stopped it ('' if it passed); a failing step is measured
    once more (a burst of foreign load on a shared machine fails one window, not two)."""
    for attempt in range(2):
        step = await sustain(system, k, cfg)
        why = verdict(step, cfg)
        print(f"  {system.name} K={k:4d}: {step['tokens_per_s']:6.0f} tok/s, ITL p99 "
              f"{step['itl_p99_ms']:5.1f} ms (direct {step['direct_itl_p99_ms']:5.1f}), router "
              f"{step['router_cpu_pct']:3.0f} %, client {step['client_cpu_pct']:3.0f} %, "
              f"engines {step['engines_cpu_pct']:3.0f} %"
              f"{' <- ' + why if why else ''}{' (again)' if attempt else ''}",
              file=sys.stderr, flush=True)
        if not why:
            break
    return step, why


async def sweep(system: System, cfg: RouterCostConfig) -> dict[str, object]:
    """Rising K until one fails the pacing (a busy step is passed over, two in a row
    end the sweep); the highest passing rate."""
    steps: list[dict[str, float]] = []
    best: dict[str, float] | None = None
    stopped, num_busy = f"all K up to {cfg.sweep_streams[-1]} passed", 0
    for k in cfg.sweep_streams:
        step, why = await step_at(system, k, cfg)
        steps.append({**step, "passed": float(not why)})
        num_busy = num_busy + 1 if why.startswith("busy") else 0
        if why and (num_busy == 0 or num_busy == 2):
            stopped = f"K={k}: {why}"
            break
        if not why:
            best = step
    return {"steps": steps, "best": best, "stopped_by": stopped}


def run_system(system: System, cfg: RouterCostConfig, with_sweep: bool,
               log_dir: Path) -> dict[str, object]:
    """The paced passes, then (``with_sweep``) the sweep, against one running system."""

    async def both() -> dict[str, object]:
        try:
            out: dict[str, object] = {"paced": await paced(system, cfg)}
            if with_sweep:
                out["sweep"] = await sweep(system, cfg)
            return out
        finally:
            await system.direct.close()

    print(f"(d) {system.name}: paced passes{' and sweep' if with_sweep else ''} "
          f"(logs in {log_dir})", file=sys.stderr, flush=True)
    return asyncio.run(both())


def run_stream(cfg: RouterCostConfig) -> dict[str, dict[str, object]]:
    """Every system in turn (pdserve for each N, then vllm-router): name -> results."""
    log_dir = new_log_dir("bench-router-stream-")
    results: dict[str, dict[str, object]] = {}
    procs, p_ep, d_ep = sims(log_dir, cfg.ms_per_token, cfg.lockstep)
    with ProcGroup(procs) as group:
        group.wait_ready(READY_TIMEOUT_S)
        engines = tuple(group.pid(p.name) for p in procs)
        for n in cfg.processes_list:
            with pdserve_router(n, p_ep, d_ep, engines, log_dir) as system:
                results[system.name] = run_system(system, cfg, True, log_dir)
    if cfg.skip_vllm_router:
        return results
    if importlib.util.find_spec("vllm_router") is None:
        print("(d) vllm-router is not installed: no baseline", file=sys.stderr)
        return results
    with vllm_router(log_dir, cfg.ms_per_token) as system:
        results[system.name] = run_system(system, cfg, False, log_dir)
    return results
