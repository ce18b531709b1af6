"""One gate for every router process (``router/dispatch/weight_board.py``): two gates on
one board file stand for two processes of ``--processes 2``: what an update does
through one holds in the other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.router.dispatch.base import Deadline
from pdserve.router.dispatch.weight_board import Published, UpdateRunning, WeightBoard
from pdserve.router.dispatch.weights import Ticket, WeightGate


@pytest.fixture
def gates(tmp_path: Path) -> Iterator[tuple[WeightGate, WeightGate]]:
    path = tmp_path / "board"
    WeightBoard.create(path, 2)
    one, two = WeightBoard.open(path), WeightBoard.open(path)
    try:
        yield WeightGate("v1", one), WeightGate("v1", two)
    finally:
        one.close()
        two.close()


async def test_an_update_through_one_process_closes_and_reopens_the_other(
        gates: tuple[WeightGate, WeightGate]) -> None:
    first, second = gates
    adopted: list[Published] = []
    second.on_published = adopted.append
    first.close()
    assert second.paused
    admitted: list[str] = []

    async def request() -> None:
        async with second.admitted("r1", Deadline.after(5)) as ticket:
            admitted.append(ticket.version)

    task = asyncio.create_task(request())
    await asyncio.sleep(0.05)
    assert admitted == []
    first.reopen(Published("v2", "/ckpt", {"d0": "v2"}))
    await asyncio.wait_for(task, 1)
    assert admitted == ["v2"] and second.version == "v2"
    assert adopted == [Published("v2", "/ckpt", {"d0": "v2"})]


async def test_a_drain_waits_for_the_other_processes_requests(
        gates: tuple[WeightGate, WeightGate]) -> None:
    first, second = gates
    release = asyncio.Event()

    async def request() -> None:
        async with second.admitted("r1", Deadline.after(5)):
            await release.wait()

    task = asyncio.create_task(request())
    await asyncio.sleep(0.02)
    first.close()
    assert not await first.wait_idle(0.05)  # the other process's request still runs
    release.set()
    assert await first.wait_idle(1.0)
    await task


@pytest.mark.parametrize("keep", [False, True])
async def test_an_abort_through_one_process_marks_the_others_requests(
        gates: tuple[WeightGate, WeightGate], keep: bool) -> None:
    first, second = gates
    release = asyncio.Event()
    tickets: list[Ticket] = []

    async def request() -> None:
        async with second.admitted("r1", Deadline.after(5)) as ticket:
            tickets.append(ticket)
            await release.wait()

    async def follower() -> list[Ticket]:  # the other process's follow loop
        while not (marked := second.follow()):
            await asyncio.sleep(0.01)
        return marked

    task = asyncio.create_task(request())
    await asyncio.sleep(0.02)
    follow = asyncio.create_task(follower())
    assert await first.abort_everywhere(keep) == []  # none of its own
    assert await asyncio.wait_for(follow, 1) == tickets
    assert tickets[0].aborted and tickets[0].kept == keep
    assert second.follow() == []  # once
    release.set()
    await task


def test_one_update_at_a_time_in_the_whole_router(
        gates: tuple[WeightGate, WeightGate]) -> None:
    first, second = gates
    with first.board.update_lock():
        with pytest.raises(UpdateRunning):
            with second.board.update_lock():
                pass
    with second.board.update_lock():  # released
        pass


def test_a_process_that_starts_late_admits_under_the_published_version(
        tmp_path: Path) -> None:
    path = tmp_path / "board"
    WeightBoard.create(path, 2)
    one = WeightBoard.open(path)
    WeightGate("", one).reopen(Published("v7"))
    late = WeightBoard.open(path)
    try:
        assert WeightGate("", late).version == "v7"
    finally:
        one.close()
        late.close()


def test_a_board_is_a_new_file_never_one_or_a_link_already_there(tmp_path: Path) -> None:
    """Like the tenants' ledger: a link planted at the board's name is not followed."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / "board").symlink_to(victim)
    with pytest.raises(FileExistsError):
        WeightBoard.create(tmp_path / "board", 2)
    assert victim.read_text() == "untouched"
