"""The router's weights gate (``router/dispatch/weights.py``): requests wait while an
update runs and are admitted under the version it ends on; an update waits for (or
marks) the requests in flight."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.dispatch.base import Deadline, DeadlineExceededError
from pdserve.router.dispatch.weights import WeightGate


async def test_a_request_arriving_during_an_update_runs_under_the_new_version() -> None:
    gate = WeightGate("v1")
    gate.close()
    admitted: list[str] = []

    async def request() -> None:
        async with gate.admitted("r1", Deadline.after(5)) as ticket:
            admitted.append(ticket.version)

    task = asyncio.create_task(request())
    await asyncio.sleep(0.05)
    assert admitted == [] and gate.paused
    gate.reopen("v2")
    await asyncio.wait_for(task, 1)
    assert admitted == ["v2"] and not gate.paused


async def test_a_closed_gate_ends_a_waiting_request_at_its_deadline() -> None:
    gate = WeightGate("v1")
    gate.close()
    with pytest.raises(DeadlineExceededError, match="weight update"):
        async with gate.admitted("r1", Deadline.after(0.05)):
            pass


async def test_an_update_waits_for_the_running_requests_or_marks_them_aborted() -> None:
    gate = WeightGate("v1")
    release = asyncio.Event()

    async def request(request_id: str) -> bool:
        async with gate.admitted(request_id, Deadline.after(5)) as ticket:
            await release.wait()
            return ticket.aborted

    tasks = [asyncio.create_task(request(f"r{i}")) for i in range(3)]
    await asyncio.sleep(0.05)
    gate.close()
    assert not await gate.wait_idle(0.05)  # three still run
    assert [t.request_id for t in gate.abort(["r1"])] == ["r1"]
    release.set()
    assert await gate.wait_idle(1.0)
    assert [await t for t in tasks] == [False, True, False]
    assert gate.running == []


async def test_abort_by_id_reaches_every_choice_of_an_n_request() -> None:
    gate = WeightGate("v1")
    async with gate.admitted("req-0", Deadline.after(5)), \
            gate.admitted("req-1", Deadline.after(5)), gate.admitted("other", Deadline.after(5)):
        assert sorted(t.request_id for t in gate.abort(["req"])) == ["req-0", "req-1"]
