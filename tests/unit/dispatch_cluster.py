"""The dispatcher test bench shared by ``test_dispatch*.py``: one fake prefill and
one fake decode worker (``fake_worker.py``) in a pool, a ``PDDispatcher`` with
round-robin placement (and ``--disagg always`` unless a test asks otherwise: the P/D
flow is what most of them check), and the helpers that read its chunks. The ``cluster``
fixture (``conftest.py``) checks for leaks when a test ends."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from unit.fake_worker import FakeWorker, FakeWorkerServicer, eventually, start_fake_worker

from pdserve.core.types import SamplingSpec
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.migration import MigrationConfig
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import RoundRobinPlacement
from pdserve.router.dispatch.workers.pool import WorkerPool

PROMPT = (11, 12, 13, 14)
FALLBACKS = "pdserve:prefill_fallbacks_total"
DECISIONS = "pdserve:disagg_decisions_total"
ALWAYS = DisaggConfig(mode="always")
WAIT_S = 2.0


@dataclass
class Cluster:
    prefill: FakeWorker
    decode: FakeWorker
    pool: WorkerPool
    dispatcher: PDDispatcher
    registry: CollectorRegistry
    baseline: set[asyncio.Task[object]]
    # Every decode worker (``decode`` is the first), for the tests that need more than one.
    decodes: tuple[FakeWorker, ...] = ()

    @property
    def p(self) -> FakeWorkerServicer:
        return self.prefill.servicer

    @property
    def d(self) -> FakeWorkerServicer:
        return self.decode.servicer

    def fallbacks(self) -> float | None:
        return self.registry.get_sample_value(FALLBACKS)

    def decisions(self, decision: str, reason: str) -> float:
        labels = {"decision": decision, "reason": reason}
        return self.registry.get_sample_value(DECISIONS, labels) or 0.0

    def new_tasks(self) -> set[asyncio.Task[object]]:
        """Tasks started since the fixture's setup (an abort in flight, a gRPC call), but
        the grpc server's own, whose coroutines are Cython's, not Python's, and a worker
        session's readers, which end on their own once their session is idle."""
        return {t for t in asyncio.all_tasks() - self.baseline - {asyncio.current_task()}
                if isinstance(coro := t.get_coro(), types.CoroutineType)
                and coro.__qualname__ not in _SESSION_TASKS}

    def assert_no_abort(self) -> None:
        """Checked right after the iterator ended: an abort would be a task by now."""
        assert not self.new_tasks(), self.new_tasks()
        assert self.p.aborts == [] and self.d.aborts == []


# A Session's tasks (its readers on the router and the worker, grpc's own that sends the
# router's side and waits for the call's end): a session outlives its last request
# (``workers/session.SESSION_IDLE_S``); ``test_worker_session`` checks that it ends.
_SESSION_TASKS = {"RouterSession._read", "WorkerSession._read",
                  "_StreamRequestMixin._consume_request_iterator",
                  "StreamStreamCall._prepare_rpc"}


@contextlib.asynccontextmanager
async def running_cluster(disagg: DisaggConfig = ALWAYS, num_decode: int = 1,
                          migration: MigrationConfig | None = None) -> AsyncIterator[Cluster]:
    """One fake prefill and ``num_decode`` fake decode workers, all healthy in the pool."""
    prefill = await start_fake_worker("prefill")
    decodes = tuple([await start_fake_worker("decode") for _ in range(num_decode)])
    pool = WorkerPool([prefill.endpoint], [d.endpoint for d in decodes])
    registry = CollectorRegistry()
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), registry, request_timeout_s=10.0,
                              disagg=disagg, migration=migration)
    await pool.refresh_all()
    assert all(w.snapshot().healthy for w in pool.all)
    c = Cluster(prefill, decodes[0], pool, dispatcher, registry, asyncio.all_tasks(), decodes)
    workers = (prefill, *decodes)
    try:
        yield c
        # Leak check: nothing running on a worker, no request counted as assigned, no task
        # (an abort, a gRPC call) left pending by the test.
        await eventually(lambda: not any(w.servicer.inflight for w in workers), WAIT_S,
                         "workers idle")
        await eventually(lambda: all(w.snapshot().num_assigned == 0 for w in pool.all), WAIT_S,
                         "num_assigned back to 0")
        await eventually(lambda: not c.new_tasks(), WAIT_S, "no task left pending")
    finally:
        await pool.close()
        await asyncio.gather(*(w.stop() for w in workers))


def spec(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0)


async def collect(chunks: AsyncIterator[TokenChunk], timeout_s: float = WAIT_S) -> list[TokenChunk]:
    async def run() -> list[TokenChunk]:
        return [c async for c in chunks]

    return await asyncio.wait_for(run(), timeout_s)


async def take(chunks: AsyncIterator[TokenChunk], n: int) -> list[TokenChunk]:
    return [await asyncio.wait_for(anext(chunks), WAIT_S) for _ in range(n)]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]
