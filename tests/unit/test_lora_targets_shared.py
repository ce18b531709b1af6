"""The LoRA targets the processes of ``--processes N`` share through their weight board:
a load or unload through one process is every process's (what it replays on a worker
that joins, what it routes by), concurrent changes of different adapters through two
processes both hold, a load no worker took is undone for all, and targets that outgrow
the board are refused whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.core.lora import LoraAdapter
from pdserve.router.dispatch.lora_catalog import LoraCatalog
from pdserve.router.dispatch.weight_board import LORA_BYTES, WeightBoard
from pdserve.router.dispatch.workers.loras import LoraTargets
from pdserve.router.dispatch.workers.pool import WorkerPool

SQL = LoraAdapter("sql", "/adapters/sql")


@pytest.fixture
def two(tmp_path: Path) -> Iterator[tuple[LoraTargets, LoraTargets]]:
    WeightBoard.create(tmp_path / "board", 2)
    boards = [WeightBoard.open(tmp_path / "board") for _ in range(2)]
    targets = (LoraTargets(), LoraTargets())
    for t, board in zip(targets, boards, strict=True):
        t.share(board)
    try:
        yield targets
    finally:
        for board in boards:
            board.close()


def test_a_load_and_an_unload_through_one_process_are_the_others(
        two: tuple[LoraTargets, LoraTargets]) -> None:
    first, second = two
    first.on_loaded(SQL)
    second.follow()
    assert second.loaded == {"sql": SQL}
    assert second.changes(()) == ([SQL], [])  # a worker joining gets it replayed
    second.on_unloaded("sql")
    first.follow()
    assert first.loaded == {} and first.unloaded == {"sql"}
    assert first.changes((SQL,)) == ([], ["sql"])  # never brought back by the other


async def test_the_catalog_of_each_process_routes_by_the_shared_targets(
        two: tuple[LoraTargets, LoraTargets]) -> None:
    first, second = two
    catalogs = []
    for targets in two:
        pool = WorkerPool([], [])
        pool.lora_targets = targets
        catalogs.append(LoraCatalog(pool, "base"))
    first.on_loaded(SQL)
    assert catalogs[1].adapter("sql") == SQL
    assert [a.name for a in catalogs[1].adapters()] == ["sql"]
    second.on_unloaded("sql")
    assert catalogs[0].adapter("sql") is None


def test_changes_of_different_adapters_through_two_processes_both_hold(
        two: tuple[LoraTargets, LoraTargets]) -> None:
    first, second = two
    first.on_loaded(SQL)
    second.on_loaded(LoraAdapter("chat", "/adapters/chat"))  # before it followed the first
    for targets in two:
        targets.follow()
        assert set(targets.loaded) == {"sql", "chat"}


def test_a_load_no_worker_took_is_undone_for_every_process(
        two: tuple[LoraTargets, LoraTargets]) -> None:
    first, second = two
    first.on_loaded(SQL)
    before = first.snapshot()
    first.on_loaded(LoraAdapter("sql", "/adapters/sql-v2"))
    first.restore(before)
    second.follow()
    assert second.loaded == {"sql": SQL}


def test_targets_that_outgrow_the_board_are_refused_and_nothing_changes(
        two: tuple[LoraTargets, LoraTargets]) -> None:
    first, second = two
    first.on_loaded(SQL)
    huge = LoraAdapter("huge", "/" + "x" * 4000)
    with pytest.raises(ValueError, match="too many LoRA adapters"):
        for i in range(LORA_BYTES // 4000 + 1):
            first.on_loaded(LoraAdapter(f"huge{i}", huge.path))
    loaded = dict(first.loaded)
    second.follow()
    assert second.loaded == loaded  # every name the board took, none it refused
    assert all(name in loaded for name in ("sql", "huge0"))
