"""What the router's metrics cost: the same router with metrics on and with
``--disable-metrics``, in front of the same two simulated workers (``pdserve sim-worker``,
1 prefill + 1 decode, no modelled compute), each a process of its own.

Rounds alternate the two routers (order shuffled per round) so that load from other
processes on a shared machine falls on both alike; each number is the median over rounds
of a per-round figure, and the difference is the median of the per-round differences:

  request_us     p50 wall time of a streamed ``max_tokens=2`` request (one prefill call,
                 one decode call)
  chunk_gap_us   median gap between streamed chunks of ``--long-tokens`` outputs
  cpu_request_us the router process's CPU time per short request
  cpu_chunk_us   the router's CPU time per chunk: (long - short request CPU) / extra chunks;
                 other processes cannot inflate it

Also, in this process, the per-chunk metric work itself (``RequestOutput._observe``:
clock read, inter-token histogram, token counter) with metrics on and off, timed over
``--observe-chunks`` calls: the floor of what the end-to-end difference can be.

Prints on/off ratios and on - off differences; target: metrics add < 50 us per chunk.

    pdserve bench metrics-overhead        # --rounds 7 --requests 60
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx
from prometheus_client import CollectorRegistry

from pdserve.bench.micro.configs import MetricsOverheadConfig
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.bench.micro.router_cost.parts import gaps, pct, sim_worker, via_router
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port
from pdserve.router.metrics import RouterMetrics

TARGET_CHUNK_US = 50.0
MODES = ("on", "off")


def children(log_dir: Path, control: bool = False) -> tuple[list[Proc], dict[str, str]]:
    """Sim prefill + sim decode + two routers in front of both (metrics on / off; both
    on with ``control``)."""
    py = (sys.executable, "-m", "pdserve.cli.main")
    ports = {name: free_port() for name in ("prefill", "decode", *MODES)}
    procs = [sim_worker(role, ports[role], log_dir) for role in ("prefill", "decode")]
    urls = {}
    for mode in MODES:
        urls[mode] = f"http://127.0.0.1:{ports[mode]}"
        off = ("--disable-metrics",) if mode == "off" and not control else ()
        procs.append(Proc(f"router-{mode}", (
            *py, "router", "--port", str(ports[mode]), "--prefill",
            f"127.0.0.1:{ports['prefill']}", "--decode", f"127.0.0.1:{ports['decode']}",
            "--log-level", "WARNING", *off),
            log_dir / f"router-{mode}.log", f"{urls[mode]}/health"))
    return procs, urls


def cpu_s(pid: int) -> float:
    """CPU seconds of every thread of ``pid`` so far, from the scheduler's own ns counters
    (``/proc/<pid>/task/*/schedstat``): psutil's clock ticks (10 ms) are too coarse for
    the few ms a round's requests cost. Threads that ended take their time with them."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # the thread ended meanwhile
            continue
    return total / 1e9


async def one_round(http: httpx.AsyncClient, pid: int, args: MetricsOverheadConfig
                    ) -> dict[str, float]:
    """One router's figures for one round."""
    await via_router(http, 2)  # warm the connection
    cpu0 = cpu_s(pid)
    short = [await via_router(http, 2) for _ in range(args.requests)]
    cpu1 = cpu_s(pid)
    long = [await via_router(http, args.long_tokens) for _ in range(args.long_requests)]
    cpu2 = cpu_s(pid)
    cpu_short = (cpu1 - cpu0) / args.requests
    cpu_long = (cpu2 - cpu1) / args.long_requests
    return {
        "request_us": 1e6 * pct([s[-1] - s[0] for s in short], 0.5),
        "chunk_gap_us": 1e6 * statistics.median(gaps(long)),
        "cpu_request_us": 1e6 * cpu_short,
        "cpu_chunk_us": 1e6 * (cpu_long - cpu_short) / (args.long_tokens - 2),
    }


Rounds = dict[str, list[dict[str, float]]]


async def run_rounds(args: MetricsOverheadConfig, urls: dict[str, str], pids: dict[str, int]
                     ) -> Rounds:
    rounds: Rounds = {mode: [] for mode in MODES}
    clients = {mode: httpx.AsyncClient(base_url=urls[mode], timeout=30) for mode in MODES}
    try:
        for i in range(args.rounds):
            order = random.Random(i).sample(MODES, len(MODES))
            for mode in order:
                rounds[mode].append(await one_round(clients[mode], pids[mode], args))
            print(f"round {i + 1}/{args.rounds}: " + ", ".join(
                f"{m} {rounds[m][-1]['cpu_chunk_us']:.1f} us/chunk" for m in MODES), flush=True)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients.values()))
    return rounds


def observe_ns(enabled: bool, n: int) -> float:
    """ns per chunk of the per-chunk metric work: ``TokenSeries.chunk`` (what
    ``RequestOutput.consume`` does for each chunk after a request's first), or, with
    metrics off, the check that skips it."""
    series = RouterMetrics(CollectorRegistry() if enabled else None, "m").tokens
    best = float("inf")
    for _ in range(5):  # best of 5: the least disturbed by other processes
        last = time.perf_counter()
        t0 = time.perf_counter_ns()
        for _ in range(n):
            if series is not None:
                last = series.chunk(last, 1)
        best = min(best, (time.perf_counter_ns() - t0) / n)
    return best


def report(rounds: Rounds) -> dict[str, float]:
    """Medians over rounds, and the median of the per-round (paired) differences: a
    round's two runs are seconds apart, so load that drifts between rounds cancels."""
    print(f"  {'median over rounds':18s} {'on':>10s} {'off':>10s} {'on/off':>8s} "
          f"{'on-off (paired)':>16s}")
    summary: dict[str, float] = {}
    for key in rounds["on"][0]:
        on = statistics.median(r[key] for r in rounds["on"])
        off = statistics.median(r[key] for r in rounds["off"])
        added = statistics.median(a[key] - b[key]
                                  for a, b in zip(rounds["on"], rounds["off"], strict=True))
        summary.update({f"{key}_on": on, f"{key}_off": off, f"{key}_added": added})
        ratio = on / off if off else float("nan")
        print(f"  {key:18s} {on:10.1f} {off:10.1f} {ratio:8.3f} {added:16.1f}")
    for key in ("chunk_gap_us", "cpu_chunk_us"):
        added = summary[f"{key}_added"]
        print(f"metrics add {added:.1f} us per chunk ({key}) = "
              f"{added / TARGET_CHUNK_US:.2f}x the {TARGET_CHUNK_US:.0f} us target")
    print(f"metrics add {summary['request_us_added']:.1f} us per request (wall, p50), "
          f"{summary['cpu_request_us_added']:.1f} us of router CPU per request")
    return summary


def run(cfg: MetricsOverheadConfig) -> int:
    observe = {mode: observe_ns(mode == "on", cfg.observe_chunks) for mode in MODES}
    print(f"per-chunk metric work in-process: on {observe['on']:.0f} ns, off "
          f"{observe['off']:.0f} ns, added {(observe['on'] - observe['off']) / 1e3:.2f} us")
    log_dir = new_log_dir("bench-metrics-overhead-")
    print(f"logs in {log_dir}", flush=True)
    procs, urls = children(log_dir, cfg.control)
    with ProcGroup(procs) as group:
        group.wait_ready(120)
        pids = {mode: group.pid(f"router-{mode}") for mode in MODES}
        summary = report(asyncio.run(run_rounds(cfg, urls, pids)))
        summary.update({f"observe_ns_{mode}": observe[mode] for mode in MODES})
        if cfg.json:
            Path(cfg.json).write_text(json.dumps(summary, indent=2))
    return 0
