"""Dispatch while the worker set changes: a decode worker that died before the
router noticed is retried once on another compatible decode worker (with the same
KV handle), and removal from the pool takes a worker out of placement at once."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry
from unit.fake_worker import start_fake_worker

from pdserve.core.types import SamplingSpec
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import RoundRobinPlacement
from pdserve.router.dispatch.workers.pool import WorkerPool

PROMPT = (11, 12, 13, 14)
ALWAYS = DisaggConfig(mode="always")  # these tests are about the P/D handoff


async def test_dead_decode_worker_is_retried_on_another() -> None:
    prefill = await start_fake_worker("prefill")
    d1, d2 = await start_fake_worker("decode"), await start_fake_worker("decode")
    pool = WorkerPool([prefill.endpoint], [d1.endpoint, d2.endpoint])
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), CollectorRegistry(), 10.0,
                              disagg=ALWAYS)
    try:
        await pool.refresh_all()
        assert all(w.snapshot().healthy for w in pool.all)
        await d1.stop()  # dead, but the pool has not noticed yet
        for i in range(4):
            chunks = [c async for c in dispatcher.generate(f"r{i}", PROMPT,
                                                           SamplingSpec(max_tokens=3))]
            assert [t for c in chunks for t in c.token_ids] == [42, 100, 101]
        (dead,) = [w for w in pool.decode if w.snapshot().endpoint == d1.endpoint]
        assert not dead.snapshot().healthy
        assert len(d2.servicer.generates) == 4  # every decode ended up on d2
        retried = [g for g in d2.servicer.generates if g.kv_handle is not None]
        assert len(retried) == 4  # with prefill's KV handle, not recomputed
    finally:
        await pool.close()
        await asyncio.gather(prefill.stop(), d2.stop())


async def test_removed_worker_leaves_placement_and_listeners_hear_it() -> None:
    d1, d2 = await start_fake_worker("decode"), await start_fake_worker("decode")
    pool = WorkerPool([], [d1.endpoint, d2.endpoint])
    removed: list[str] = []
    pool.on_worker_removed(lambda s: removed.append(s.endpoint))
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), CollectorRegistry(), 10.0,
                              disagg=ALWAYS)
    try:
        await pool.refresh_all()
        await pool.delete(f"decode/{d1.endpoint}")
        assert removed == [d1.endpoint]
        assert [w.snapshot().endpoint for w in pool.decode] == [d2.endpoint]
        for i in range(3):
            _ = [c async for c in dispatcher.generate(f"r{i}", PROMPT,
                                                      SamplingSpec(max_tokens=2))]
        assert not d1.servicer.generates and len(d2.servicer.generates) == 3
    finally:
        await pool.close()
        await asyncio.gather(d1.stop(), d2.stop())
