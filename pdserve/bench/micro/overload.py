"""Overload: what admission control does when clients offer more than the router admits.

Starts ``pdserve up --simulated`` (the router is what is measured; simulated workers
answer in modelled time, so the workers are not the bottleneck being probed) with
``--max-concurrent-requests C --max-queued-requests Q --max-queue-wait-s W``, then for
each offered rate in ``--rates`` (req/s, Poisson arrivals, open loop: a refused client
does not slow the offer down) runs ``--duration-s`` of streamed completions and
reports: offered and admitted rate, the 429 share (and whether each 429 carried
``Retry-After``), other errors (5xx must be 0), p50/p99 latency of the admitted
requests, and the router's RSS at the start, its peak and at the end of each rate.

    HF_HUB_OFFLINE=1 pdserve bench overload
    HF_HUB_OFFLINE=1 pdserve bench overload --rates 20 80 320 --duration-s 20
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import statistics
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from pdserve.bench.micro.configs import OverloadConfig
from pdserve.bench.micro.faults import Cluster  # the same `pdserve up` handle as the faults
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port

console = Console()


@dataclass
class RateResult:
    offered_rps: float
    duration_s: float
    statuses: Counter[str] = field(default_factory=Counter)
    retry_after_missing: int = 0
    latencies_s: list[float] = field(default_factory=list)  # admitted (200) requests
    rss_mib: dict[str, float] = field(default_factory=dict)  # start, peak, end

    @property
    def sent(self) -> int:
        return sum(self.statuses.values())

    def summary(self) -> dict[str, Any]:
        ok = self.statuses.get("200", 0)
        lat = sorted(self.latencies_s)
        return {
            "offered_rps": self.offered_rps, "sent": self.sent,
            "offered_rps_measured": round(self.sent / self.duration_s, 1),
            "admitted_rps": round(ok / self.duration_s, 1),
            "share_429": round(self.statuses.get("429", 0) / max(1, self.sent), 3),
            "retry_after_missing": self.retry_after_missing,
            "statuses": dict(self.statuses),
            "p50_s": round(statistics.median(lat), 3) if lat else None,
            "p99_s": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 3) if lat else None,
            "router_rss_mib": self.rss_mib,
        }


async def one(client: httpx.AsyncClient, url: str, max_tokens: int, deadline_s: float,
              result: RateResult) -> None:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Count to ten:", "stream": True,
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    started = time.perf_counter()
    try:
        async with asyncio.timeout(deadline_s):
            async with client.stream("POST", url + "/completions", json=body) as reply:
                status = str(reply.status_code)
                if reply.status_code == 429 and "retry-after" not in reply.headers:
                    result.retry_after_missing += 1
                async for line in reply.aiter_lines():
                    if line.startswith("data: {") and '"error"' in line:
                        status = "sse_error"
    except TimeoutError:
        status = "hung"
    except httpx.HTTPError as exc:
        status = type(exc).__name__
    result.statuses[status] += 1
    if status == "200":
        result.latencies_s.append(time.perf_counter() - started)


class RssSampler:
    """The router's RSS every 0.2 s on a thread (start, peak, end in MiB)."""

    def __init__(self, proc: psutil.Process) -> None:
        self.proc = proc
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> float:
        return self.proc.memory_info().rss / 2**20

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.samples.append(self._rss())

    def __enter__(self) -> RssSampler:
        self.samples.append(self._rss())
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.samples.append(self._rss())

    def summary(self) -> dict[str, float]:
        return {"start": round(self.samples[0], 1), "peak": round(max(self.samples), 1),
                "end": round(self.samples[-1], 1)}


async def run_rate(url: str, rate: float, args: OverloadConfig,
                   router: psutil.Process) -> RateResult:
    result = RateResult(rate, args.duration_s)
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.max_connections, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.deadline_s), limits=limits) as c:
        with RssSampler(router) as rss:
            tasks: list[asyncio.Task[None]] = []
            end = time.monotonic() + args.duration_s
            while time.monotonic() < end:
                tasks.append(asyncio.create_task(one(c, url, args.max_tokens,
                                                     args.deadline_s, result)))
                await asyncio.sleep(rng.expovariate(rate))
            await asyncio.gather(*tasks)
            await asyncio.sleep(1.0)  # let the router settle before the end sample
        result.rss_mib = rss.summary()
    return result


def report(results: list[RateResult], args: OverloadConfig) -> Table:
    table = Table(title=f"router under overload (concurrency {args.max_concurrent}, queue "
                        f"{args.max_queued}, queue wait {args.max_queue_wait_s}s; "
                        f"{args.duration_s:.0f}s per rate)")
    for column in ("offered req/s", "sent", "admitted req/s", "429 share", "other non-200",
                   "p50 s", "p99 s", "router RSS MiB start/peak/end"):
        table.add_column(column, justify="right")
    for r in results:
        s = r.summary()
        other = {k: v for k, v in s["statuses"].items() if k not in ("200", "429")}
        rss = s["router_rss_mib"]
        table.add_row(f"{s['offered_rps_measured']}", str(s["sent"]), str(s["admitted_rps"]),
                      f"{s['share_429']:.0%}", str(other or 0), str(s["p50_s"]),
                      str(s["p99_s"]), f"{rss['start']}/{rss['peak']}/{rss['end']}")
    return table


async def main_async(args: OverloadConfig) -> int:
    log_dir = new_log_dir("overload-")
    port = free_port()
    up_argv = ["--simulated", "--port", str(port), "--num-prefill", "1",
               "--num-decode", "1", "--max-concurrent-requests", str(args.max_concurrent),
               "--max-queued-requests", str(args.max_queued), "--max-queue-wait-s",
               str(args.max_queue_wait_s), "--log-level", "WARNING"]
    console.print(f"pdserve up {' '.join(up_argv)}  (log {log_dir / 'up.log'})")
    cluster = Cluster(up_argv, port, log_dir, 300)
    results: list[RateResult] = []
    try:
        router = cluster.process("router")
        await run_rate(cluster.base_url, 2.0, dataclasses.replace(args, duration_s=3.0),
                       router)  # warm-up, not reported
        for rate in args.rates:
            results.append(await run_rate(cluster.base_url, rate, args, router))
            console.print(report(results[-1:], args))
    finally:
        cluster.stop()
    console.print(report(results, args))
    out = Path(args.json or log_dir / "overload.json")
    out.write_text(json.dumps({"args": dataclasses.asdict(args),
                               "results": [r.summary() for r in results]}, indent=2, default=str))
    console.print(f"wrote {out}")
    bad = sum(n for r in results for k, n in r.statuses.items()
              if k.startswith("5") or k in ("hung", "sse_error"))
    return 1 if bad else 0


def run(cfg: OverloadConfig) -> int:
    return asyncio.run(main_async(cfg))
