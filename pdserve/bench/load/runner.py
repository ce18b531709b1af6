"""One benchmark run: check the endpoint, warm it up, send the workload on schedule,
collect records, summarize.

Open loop: each request is sent at its arrival time (``arrivals.py``) whether or not
earlier ones finished; ``--max-concurrency`` caps how many are in flight (a request whose
time has come waits for a slot, as in ``vllm bench serve``). Closed loop: ``--request-rate
inf --max-concurrency C`` keeps C in flight. A request that carries its own arrival time
(a trace's, ``BenchRequest.arrival_s``) is sent then instead. ``--num-requests N`` draws
N prompts (those over the context are skipped and counted, not sent); ``--duration-s S``
sends until S seconds have passed and waits for what is in flight.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from pdserve.bench.load.client import Endpoint, send
from pdserve.bench.load.metrics import RequestRecord
from pdserve.bench.workload.arrivals import arrival_times, arrivals_until
from pdserve.bench.workload.prompts import BenchRequest, PromptEncoder

PROBE_TIMEOUT_S = 10.0
WARMUP_SEED_OFFSET = 1_000_003  # warm-up prompts are not the measured ones
MAX_SKIPPED_IN_A_ROW = 1000  # duration mode: give up when no prompt fits


@dataclass(frozen=True)
class Schedule:
    num_requests: int | None
    duration_s: float | None
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    seed: int

    def __post_init__(self) -> None:
        if (self.num_requests is None) == (self.duration_s is None):
            raise ValueError("give one of --num-requests and --duration-s")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError("--num-requests must be >= 1")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError("--duration-s must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("--max-concurrency must be >= 1")
        if not self.request_rate > 0 or not self.burstiness > 0:
            raise ValueError("--request-rate and --burstiness must be > 0 (rate may be inf)")
        if (self.duration_s is not None and math.isinf(self.request_rate)
                and self.max_concurrency is None):
            raise ValueError("--duration-s with --request-rate inf needs --max-concurrency")


@dataclass
class Outcome:
    records: list[RequestRecord] = field(default_factory=list)
    num_drawn: int = 0
    num_skipped: int = 0
    error_examples: dict[str, str] = field(default_factory=dict)
    duration_s: float = 0.0


async def list_models(client: httpx.AsyncClient, ep: Endpoint) -> dict[str, dict[str, Any]] | None:
    """The endpoint's model cards by id; None when it has no ``/models`` (404)."""
    try:
        reply = await client.get(ep.base_url + "/models", headers=ep.headers,
                                 timeout=PROBE_TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {ep.base_url}/models: {exc or type(exc).__name__}"
                         ) from None
    if reply.status_code in (401, 403):
        raise ValueError(f"{ep.base_url}/models answered {reply.status_code}: wrong or "
                         "missing --api-key (or PDSERVE_API_KEY / OPENAI_API_KEY)")
    if reply.status_code == 404:
        return None
    try:
        reply.raise_for_status()
        return {str(c["id"]): c for c in reply.json()["data"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        raise ValueError(f"{ep.base_url}/models answered {reply.status_code} without an "
                         "OpenAI model list; is this an OpenAI-compatible server?") from None


def check_model(cards: dict[str, dict[str, Any]] | None, ep: Endpoint) -> int | None:
    """Check that the endpoint serves ``ep.model`` (without a model list, the warm-up
    request finds out); its ``max_model_len`` if the card says."""
    if cards is None:
        return None
    if ep.model not in cards:
        raise ValueError(f"model {ep.model!r} is not served at {ep.base_url} "
                         f"(it serves: {', '.join(cards) or 'nothing'})")
    max_len = cards[ep.model].get("max_model_len")
    return int(max_len) if isinstance(max_len, int) else None


def _fits(req: BenchRequest, max_model_len: int | None) -> bool:
    return max_model_len is None or req.prompt_tokens + req.output_tokens <= max_model_len


class Runner:
    """Sends one run's requests on ``client``; ``run`` may be called again (sweeps)."""

    def __init__(self, client: httpx.AsyncClient, ep: Endpoint, encoder: PromptEncoder,
                 max_model_len: int | None, show_progress: bool) -> None:
        self.client, self.ep, self.encoder = client, ep, encoder
        self.max_model_len, self.show_progress = max_model_len, show_progress

    async def warm_up(self, workload: Iterable[BenchRequest], num: int) -> None:
        """``num`` requests one after another; any failure ends the run (a wrong model or
        key shows here on servers without a model list)."""
        fitting = (r for r in workload if _fits(r, self.max_model_len))
        for req in itertools.islice(fitting, num):
            record, detail = await send(self.client, self.ep, self.encoder, req,
                                        time.perf_counter())
            if record.error is not None:
                raise ValueError(f"warm-up request to {self.ep.url} failed "
                                 f"({record.error}): {detail}")

    def _progress(self) -> Progress:
        return Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True),
                        disable=not self.show_progress, transient=True)

    async def run(self, workload: Iterable[BenchRequest], sched: Schedule) -> Outcome:
        out = Outcome()
        requests: Iterator[BenchRequest] = iter(workload)
        arrivals: Iterator[float] | None = None
        if sched.num_requests is not None:
            drawn = list(itertools.islice(requests, sched.num_requests))
            sendable = [r for r in drawn if _fits(r, self.max_model_len)]
            out.num_drawn, out.num_skipped = len(drawn), len(drawn) - len(sendable)
            requests = iter(sendable)
            arrivals = iter(arrival_times(len(sendable), sched.request_rate,
                                          sched.burstiness, sched.seed))
        elif not math.isinf(sched.request_rate):
            arrivals = arrivals_until(float(sched.duration_s or 0), sched.request_rate,
                                      sched.burstiness, sched.seed)
        total = out.num_drawn - out.num_skipped if sched.num_requests is not None else None
        with self._progress() as progress:
            task = progress.add_task("bench", total=total)
            await self._send_all(requests, arrivals, sched, out,
                                 lambda: progress.advance(task))
        return out

    async def _send_all(self, requests: Iterator[BenchRequest], arrivals: Iterator[float] | None,
                        sched: Schedule, out: Outcome, advance: Any) -> None:
        slots = asyncio.Semaphore(sched.max_concurrency) if sched.max_concurrency else None
        start = time.perf_counter()
        tasks: list[asyncio.Task[None]] = []

        async def one(req: BenchRequest) -> None:
            try:
                record, detail = await send(self.client, self.ep, self.encoder, req, start)
            finally:
                if slots is not None:
                    slots.release()
            out.records.append(record)
            if record.error is not None:
                out.error_examples.setdefault(record.error, detail or "")
            advance()

        def over() -> bool:
            return sched.duration_s is not None and time.perf_counter() - start >= sched.duration_s

        for req in requests:
            if sched.num_requests is None and not _fits(req, self.max_model_len):
                out.num_drawn, out.num_skipped = out.num_drawn + 1, out.num_skipped + 1
                if not tasks and out.num_skipped >= MAX_SKIPPED_IN_A_ROW:
                    raise ValueError(f"the first {out.num_skipped} prompts all exceed the "
                                     f"context ({self.max_model_len} tokens)")
                continue
            if req.arrival_s is not None:  # a trace's own time
                await asyncio.sleep(max(0.0, start + req.arrival_s - time.perf_counter()))
            elif arrivals is not None:
                at = next(arrivals, None)
                if at is None:
                    break
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            if slots is not None:
                await slots.acquire()
            if over():
                if slots is not None:
                    slots.release()
                break
            if sched.num_requests is None:
                out.num_drawn += 1
            tasks.append(asyncio.create_task(one(req)))
        await asyncio.gather(*tasks)
        out.records.sort(key=lambda r: r.start_s)
        out.duration_s = time.perf_counter() - start
