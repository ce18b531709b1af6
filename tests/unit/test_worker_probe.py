"""The router's health probe: a late answer is a busy worker, a refused one is gone."""

from __future__ import annotations

import asyncio

from pdserve.core.types import WorkerHealth, WorkerLoadReport
from pdserve.membership import WorkerInfo
from pdserve.router.dispatch.workers.client import DEADLINE_EXCEEDED, UNAVAILABLE, WorkerCallError
from pdserve.router.dispatch.workers.pool import MAX_SLOW_PROBES, Worker


class ScriptedClient:
    """Answers Health from a script of outcomes: ``None`` is a good reply, a code fails."""

    def __init__(self, outcomes: list[str | None]) -> None:
        self.outcomes = outcomes
        self.endpoint = "127.0.0.1:1"
        self.ready = True  # what a good reply says (a worker committing weights: False)

    async def health(self, timeout_s: float) -> WorkerHealth:
        code = self.outcomes.pop(0)
        if code is not None:
            raise WorkerCallError(code, "scripted")
        return WorkerHealth(ready=self.ready, role="prefill", worker_id="127.0.0.1:1", model="m",
                            dtype="float32", block_size=16, max_model_len=64,
                            transport="tcp", compatibility_hash="h")

    async def load(self, timeout_s: float) -> WorkerLoadReport:
        return WorkerLoadReport()


def _worker(outcomes: list[str | None]) -> Worker:
    worker = Worker(WorkerInfo(worker_id="127.0.0.1:1", role="prefill",
                               grpc_endpoint="127.0.0.1:1"))
    worker.client = ScriptedClient(outcomes)  # type: ignore[assignment]
    return worker


async def test_late_probes_keep_a_worker_until_too_many_in_a_row() -> None:
    late = [DEADLINE_EXCEEDED] * (MAX_SLOW_PROBES - 1)
    worker = _worker([None, *late, None, *late, DEADLINE_EXCEEDED])
    await worker.refresh(1.0)
    assert worker.snapshot().healthy
    for _ in late:  # late, but not often enough in a row
        await worker.refresh(1.0)
        assert worker.snapshot().healthy
    await worker.refresh(1.0)  # a good answer resets the count
    for _ in late:
        await worker.refresh(1.0)
    assert worker.snapshot().healthy
    await worker.refresh(1.0)
    assert not worker.snapshot().healthy


async def test_unreachable_worker_leaves_placement_at_once() -> None:
    worker = _worker([None, UNAVAILABLE])
    await worker.refresh(1.0)
    assert worker.snapshot().healthy
    await worker.refresh(1.0)
    assert not worker.snapshot().healthy


async def test_a_commit_answered_through_another_process_makes_the_worker_placeable() -> None:
    """A probe during a weight commit finds the worker not ready; the commit's answer
    (here: published by another router process) says it serves the new version, ready,
    without waiting for the next probe."""
    worker = _worker([None, None])
    worker.set_weight_target("v1")
    await worker.refresh(1.0)
    assert not worker.snapshot().healthy  # not on the target version
    worker.client.ready = False  # type: ignore[attr-defined]
    await worker.refresh(1.0)  # mid-commit
    worker.set_weight_target("v2")
    worker.on_weights_committed("v2")
    state = worker.snapshot()
    assert state.healthy and state.weight_version == "v2"


async def test_a_probe_out_when_a_call_finds_the_worker_gone_adopts_nothing() -> None:
    """A probe answered, then a request's call to the worker fails unreachable (it
    stopped in between), then the probe's answer is read: the failure is the newer
    news, so the worker stays out of placement until the next probe. Before, the old
    answer put a stopped worker back (a unit test saw it under load)."""
    worker = _worker([None, None])
    await worker.refresh(1.0)
    gate = asyncio.Event()
    answered = worker.client.load

    async def held_load(timeout_s: float) -> WorkerLoadReport:
        await gate.wait()  # the answer sits until the call has failed
        return await answered(timeout_s)

    worker.client.load = held_load  # type: ignore[method-assign]
    probe = asyncio.create_task(worker.refresh(1.0))
    await asyncio.sleep(0)
    worker.mark_unhealthy(UNAVAILABLE)  # what a request's failed call does
    gate.set()
    await probe
    assert not worker.snapshot().healthy
