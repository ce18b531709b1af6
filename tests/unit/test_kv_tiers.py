"""The host tier without an engine: its index (LRU, pins, hard cap), its memory (a
save then a load gives the same bytes; a slot that no longer holds its block, or
whose bytes changed, loads nothing), and the scheduler side's plan: which blocks a
finished request saves, which a new request loads, and that the ids coming back
from the worker unpin, commit or forget the right slots.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.metadata import NO_COPY, TierCopy
from pdserve.kv_transfer.scheduler_side import SchedulerSide
from pdserve.kv_transfer.tiers import disk as disk_module
from pdserve.kv_transfer.tiers.disk import DiskTier, scan
from pdserve.kv_transfer.tiers.host import HostTier, num_slots
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.plan import TierPlanner
from pdserve.kv_transfer.tiers.store import TierStore

BS = 128
CONFIG = ConnectorConfig(engine_id="worker-0", kv_offload_gib=0.01)


def _h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


# ---- the index ------------------------------------------------------------------------

def test_match_is_the_longest_held_prefix() -> None:
    index = TierIndex(8)
    slots = [slot for _, slot in index.reserve([_h(1), _h(2), _h(3)])]
    assert index.match([_h(1)]) == []  # written, not yet committed: not matchable
    index.commit(slots)
    assert index.match([_h(1), _h(2), _h(4), _h(3)]) == slots[:2]
    assert index.match([_h(9), _h(1)]) == []


def test_reserve_skips_what_is_held_or_being_written() -> None:
    index = TierIndex(8)
    first = index.reserve([_h(1), _h(2)])
    assert [i for i, _ in index.reserve([_h(1), _h(2), _h(3)])] == [2]
    index.commit([slot for _, slot in first])
    assert index.reserve([_h(1), _h(2)]) == []


def test_the_least_recently_used_goes_first_and_a_pinned_slot_never() -> None:
    index = TierIndex(3)
    index.commit([slot for _, slot in index.reserve([_h(1), _h(2), _h(3)])])
    index.match([_h(1)])  # 1 is now the most recently used: 2 is the oldest
    (pinned,) = index.match([_h(2)])  # and now 2 is, but it is pinned: 3 is evictable
    index.pin([pinned])
    index.commit([slot for _, slot in index.reserve([_h(4)])])  # evicts 3, not pinned 2
    assert index.match([_h(3)]) == [] and index.match([_h(2)]) == [pinned]
    assert index.num_evictions == 1
    index.pin(index.match([_h(1)]) + index.match([_h(4)]))
    assert index.reserve([_h(5)]) == []  # every slot pinned: nothing is evicted
    assert len(index) == 3


def test_a_slot_discarded_while_pinned_is_freed_once_unpinned() -> None:
    index = TierIndex(1)
    (slot,) = [s for _, s in index.reserve([_h(1)])]
    index.commit([slot])
    index.pin([slot])
    index.discard([slot])
    assert index.match([_h(1)]) == [] and index.reserve([_h(2)]) == []
    index.unpin([slot])
    assert index.reserve([_h(2)]) == [(0, slot)]


def test_the_index_never_holds_more_than_its_slots() -> None:
    rng = random.Random(7)
    index = TierIndex(16)
    pinned: list[int] = []
    for _ in range(2000):
        hashes = [_h(rng.randrange(64)) for _ in range(rng.randrange(1, 6))]
        op = rng.random()
        if op < 0.5:
            slots = [s for _, s in index.reserve(hashes)]
            (index.commit if rng.random() < 0.9 else index.discard)(slots)
        elif op < 0.8:
            got = index.match(hashes)
            index.pin(got)
            pinned += got
        elif pinned:
            index.unpin([pinned.pop(rng.randrange(len(pinned)))])
        assert len(index) <= 16
        assert len(set(index._held.values())) == len(index)  # no slot named twice


def test_num_slots_is_what_fits() -> None:
    assert num_slots(1.0, 1 << 20) == 1024
    assert num_slots(0.0, 1 << 20) == 0


# ---- the memory -----------------------------------------------------------------------

def _kv(num_blocks: int = 6) -> tuple[list[torch.Tensor], KVLayout]:
    torch.manual_seed(0)
    kv = {f"layer.{i}": torch.randn(num_blocks, 3, 16, 8) for i in range(4)}
    return list(kv.values()), KVLayout.from_kv_caches(kv, num_blocks, 16)


@pytest.mark.parametrize("verify", [False, True])
def test_a_saved_block_loads_back_bit_for_bit(verify: bool) -> None:
    kv, layout = _kv()
    tier = HostTier(kv, layout, num_slots=4, verify=verify)
    want = [layer[[1, 2]].clone() for layer in kv]
    tier.save([1, 2], [3, 0], [_h(1), _h(2)])
    for layer in kv:
        layer[[4, 5]] = 0
    assert tier.load([3, 0], [4, 5], [_h(1), _h(2)]) == 2 * tier.block_bytes
    for layer, w in zip(kv, want, strict=True):
        assert torch.equal(layer[[4, 5]], w)


@pytest.mark.parametrize("slots", [[0, 1, 2, 3, 4], [4, 2, 3, 7, 0], [6, 7, 0, 1, 2]])
def test_runs_of_slots_copy_whole_and_land_in_their_slots_with_blocks_in_dim_1(
        slots: list[int]) -> None:
    """A CUDA layout (K and V first, blocks in dim 1) on CPU: the run copies (one per run
    of consecutive slots, per K and V) put each block in its own slot and back."""
    torch.manual_seed(1)
    kv = {f"layer.{i}": torch.randn(2, 12, 16, 3, 8) for i in range(3)}
    tier = HostTier(list(kv.values()), KVLayout.from_kv_caches(kv, 12, 16), num_slots=8,
                    verify=True)
    blocks = [9, 1, 5, 6, 11]
    want = {b: [layer[:, b].clone() for layer in kv.values()] for b in blocks}
    tier.save(blocks, slots, [_h(b) for b in blocks])
    for block in blocks:  # what a peer's pool pull reads: per layer, K then V
        chunks, _, _ = tier.serve([_h(block)])
        assert torch.equal(torch.cat(chunks), torch.cat(want[block]))
    for layer in kv.values():
        layer.zero_()
    back = [0, 10, 2, 3, 4]  # loaded into other blocks, in another order of runs
    tier.load(slots, back, [_h(b) for b in blocks])
    for block, into in zip(blocks, back, strict=True):
        assert all(torch.equal(layer[:, into], w) for layer, w in zip(kv.values(), want[block],
                                                                      strict=True))
    assert all(layer[:, 5].abs().sum() == 0 for layer in kv.values())  # nothing else written


def test_a_slot_that_holds_another_block_loads_nothing() -> None:
    kv, layout = _kv()
    tier = HostTier(kv, layout, num_slots=4, verify=False)
    tier.save([1], [0], [_h(1)])
    tier.save([2], [0], [_h(2)])  # the slot was reused for another block
    before = [layer[5].clone() for layer in kv]
    with pytest.raises(TransferError, match="holds another block"):
        tier.load([0], [5], [_h(1)])
    assert all(torch.equal(layer[5], b) for layer, b in zip(kv, before, strict=True))


def test_corrupt_bytes_fail_the_checksum_and_load_nothing() -> None:
    kv, layout = _kv()
    tier = HostTier(kv, layout, num_slots=4, verify=True)
    tier.save([1], [2], [_h(1)])
    chunks, _, _ = tier.serve([_h(1)])  # the slot's memory itself (a pull sends it as is)
    chunks[3].view(-1)[7] += 1.0  # one value of one layer flips
    before = [layer[5].clone() for layer in kv]
    with pytest.raises(TransferError, match="checksum"):
        tier.load([2], [5], [_h(1)])
    assert all(torch.equal(layer[5], b) for layer, b in zip(kv, before, strict=True))


# ---- the scheduler side's plan --------------------------------------------------------

def _host(num: int) -> TierPlanner:
    return TierPlanner(BS, TierIndex(num), None)


def _request(req_id: str, num_tokens: int, computed: int | None = None) -> Any:
    hashes = [_h(1000 + i) for i in range(num_tokens // BS)]
    return SimpleNamespace(request_id=req_id, kv_transfer_params=None,
                           num_tokens=num_tokens, block_hashes=hashes,
                           all_token_ids=list(range(num_tokens)),
                           num_computed_tokens=num_tokens if computed is None else computed,
                           use_structured_output=False, cache_salt=None)


def _alloc(new: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(([KVCacheBlock(b) for b in new],))


def _step(side: SchedulerSide) -> Any:
    return side.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        total_num_scheduled_tokens=1, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={}))


def _done(side: SchedulerSide, sending: set[str] = frozenset(),  # type: ignore[assignment]
          recving: set[str] = frozenset(), failed: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    side.update_connector_output(SimpleNamespace(  # type: ignore[arg-type]
        finished_sending=set(sending), finished_recving=set(recving),
        failed_recving=set(failed)))


def test_a_finished_request_saves_its_computed_full_blocks_and_holds_them() -> None:
    side = SchedulerSide(CONFIG, BS, _host(8))
    held, params = side.request_finished(_request("a", 3 * BS + 40), [7, 8, 9, 10])
    assert (held, params) == (True, None)
    save = _step(side).tier_saves["a"]
    assert save.block_ids == (7, 8, 9) and len(save.slots) == 3  # the partial block stays
    # half-computed (aborted mid-prefill): only what was computed
    # aborted mid-prefill: only what was computed (one block, which a is writing)
    held, _ = side.request_finished(_request("b", 5 * BS, computed=BS + 3), [1, 2, 3, 4, 5])
    assert _step(side).tier_saves == {} and held is False


def test_a_new_request_loads_what_the_engine_lost_from_the_tier() -> None:
    side = SchedulerSide(CONFIG, BS, _host(8))
    side.request_finished(_request("a", 3 * BS + 40), [7, 8, 9, 10])
    saved = _step(side).tier_saves["a"]
    assert side.get_num_new_matched_tokens(_request("x", 3 * BS + 40, 0), 0) == (0, False)
    _done(side, sending={"a"})  # the save is done: matchable now
    again = _request("a2", 3 * BS + 40, computed=0)
    # the engine still holds the first block: the tier adds the next two
    assert side.get_num_new_matched_tokens(again, BS) == (2 * BS, True)
    side.update_state_after_alloc(again, _alloc([30, 31, 32]), 2 * BS)
    load = _step(side).tier_loads["a2"]
    assert load.block_ids == (30, 31) and load.slots == saved.slots[1:]
    assert side.tier_tokens("a2") == {"host": 2 * BS}
    _done(side, recving={"a2"})
    assert side.tier_tokens("a2") == {}


def test_a_weight_update_drops_every_tier_block_and_the_router_hears_of_each() -> None:
    side = SchedulerSide(CONFIG, BS, TierPlanner(BS, TierIndex(8), TierIndex(8)))
    side.request_finished(_request("a", 3 * BS + 40), [7, 8, 9, 10])
    _step(side)
    _done(side, sending={"a"})
    stored = side.take_events()
    assert [stored_ for _, stored_, _ in stored] == [True, True]  # host and disk hold 3
    assert side.reset_tiers() == 6  # vLLM's reset_prefix_cache(reset_connector=True)
    removed = side.take_events()
    assert {(tier, was) for tier, was, _ in removed} == {("host", False), ("disk", False)}
    assert sorted(h for _, _, hs in removed for h in hs) == sorted(
        h for _, _, hs in stored for h in hs)
    again = _request("a2", 3 * BS + 40, computed=0)
    assert side.get_num_new_matched_tokens(again, 0) == (0, False)  # nothing matches


def test_never_the_last_token_and_a_failed_load_forgets_its_blocks() -> None:
    side = SchedulerSide(CONFIG, BS, _host(8))
    side.request_finished(_request("a", 2 * BS), [7, 8])
    _step(side)
    _done(side, sending={"a"})
    exact = _request("b", 2 * BS, computed=0)  # a prompt of exactly the saved blocks
    assert side.get_num_new_matched_tokens(exact, 0) == (BS, True)  # its last is computed
    side.update_state_after_alloc(exact, _alloc([40, 41]), BS)
    _step(side)
    _done(side, recving={"b"}, failed={"b"})  # its bytes were bad
    assert side.get_num_new_matched_tokens(_request("c", 2 * BS, 0), 0) == (0, False)


def test_a_match_that_is_not_allocated_unpins_and_tiers_off_changes_nothing() -> None:
    side = SchedulerSide(CONFIG, BS, _host(2))
    side.request_finished(_request("a", 2 * BS + 1), [7, 8, 9])
    _step(side)
    _done(side, sending={"a"})
    waiting = _request("w", 2 * BS + 1, computed=0)
    assert side.get_num_new_matched_tokens(waiting, 0) == (2 * BS, True)
    side.update_state_after_alloc(waiting, _alloc([]), 0)  # vLLM took none of it
    assert side.tiers is not None
    host = side.tiers.index("host")
    assert host is not None and host._pins == {}
    off = SchedulerSide(CONFIG, BS)
    assert off.request_finished(_request("a", 2 * BS + 1), [7, 8, 9]) == (False, None)
    assert off.get_num_new_matched_tokens(_request("b", 2 * BS + 1, 0), 0) == (0, False)
    assert _step(off).tier_saves == {} and off.tiers is None


# ---- the disk tier --------------------------------------------------------------------

def _disk(tmp_path: Path, compat: str = "model-a") -> tuple[DiskTier, list[torch.Tensor]]:
    kv, layout = _kv()
    return DiskTier(tmp_path, compat, kv, layout), kv


def test_a_block_written_to_disk_loads_back_bit_for_bit(tmp_path: Path) -> None:
    disk, kv = _disk(tmp_path)
    want = [layer[[1, 2]].clone() for layer in kv]
    disk.save([1, 2], [0, 5], [_h(1), _h(2)])
    for layer in kv:
        layer[[3, 4]] = 0
    assert disk.load([0, 5], [3, 4], [_h(1), _h(2)]) == 2 * disk.block_bytes
    assert all(torch.equal(layer[[3, 4]], w) for layer, w in zip(kv, want, strict=True))


@pytest.mark.parametrize("damage", ["truncate", "flip", "missing", "reused"])
def test_a_damaged_block_file_loads_nothing(tmp_path: Path, damage: str) -> None:
    disk, kv = _disk(tmp_path)
    disk.save([1, 2], [0, 1], [_h(1), _h(2)])
    path = disk.path(1)
    raw = bytearray(path.read_bytes())
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        raw[-100] ^= 0xFF
        path.write_bytes(raw)
    elif damage == "missing":
        path.unlink()
    else:
        disk.save([3], [1], [_h(3)])  # the slot now holds another block
    before = [layer[[4, 5]].clone() for layer in kv]
    with pytest.raises(TransferError):
        disk.load([0, 1], [4, 5], [_h(1), _h(2)])
    # every file is checked before any block is written: the good one did not land either
    assert all(torch.equal(layer[[4, 5]], b) for layer, b in zip(kv, before, strict=True))


def test_a_restart_finds_its_blocks_and_reports_another_models(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    disk, _ = _disk(tmp_path, "model-a")
    disk.save([1], [3], [_h(1)])
    disk.save([2], [0], [_h(2)])
    other, _ = _disk(tmp_path, "model-b")
    other.save([1], [0], [_h(9)])
    (disk.folder / "2.kv").write_bytes(b"not a block file")
    found = scan(tmp_path, "model-a", num_slots=8)
    assert found == [(3, _h(1)), (0, _h(2))]  # oldest first; the bad file is not
    assert "1 block files of another model or layout ignored" in caplog.text
    index = TierIndex(8)
    for slot, block_hash in found:
        index.adopt(slot, block_hash)
    assert index.match([_h(1), _h(2)]) == [3, 0]


def test_a_full_disk_is_a_counted_save_failure_then_a_recompute(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kv, layout = _kv()
    store = TierStore(kv, layout, host_slots=0, verify=False, disk_dir=str(tmp_path),
                      disk_compat="model-a")

    def full(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_module, "_open_private", full)  # how a block file is written
    copy = TierCopy((1,), (0,), (_h(1),))
    assert store.save("r", NO_COPY, copy) == 0  # never raises: the blocks can be freed
    monkeypatch.undo()
    assert store.stats()["disk_save_failures"] == 1
    with pytest.raises(TransferError):
        store.load("r2", NO_COPY, TierCopy((4,), (0,), (_h(1),)))
    assert store.stats()["disk_load_failures"] == 1


def test_the_plan_loads_from_host_then_disk_and_writes_through_both() -> None:
    side = SchedulerSide(CONFIG, BS, TierPlanner(BS, TierIndex(1), TierIndex(8)))
    side.request_finished(_request("a", 3 * BS + 1), [7, 8, 9, 10])
    meta = _step(side)
    assert len(meta.tier_saves["a"].slots) == 1  # the host holds one block
    assert meta.disk_saves["a"].block_ids == (7, 8, 9)  # the disk all three
    _done(side, sending={"a"})
    again = _request("b", 3 * BS + 1, computed=0)
    assert side.get_num_new_matched_tokens(again, 0) == (3 * BS, True)
    side.update_state_after_alloc(again, _alloc([20, 21, 22, 23]), 3 * BS)
    meta = _step(side)
    host, disk = meta.tier_loads["b"], meta.disk_loads["b"]
    assert host.block_ids == (20,) and disk.block_ids == (21, 22)
    assert side.tier_tokens("b") == {"host": BS, "disk": 2 * BS}


def test_a_request_aborted_mid_load_saves_nothing() -> None:
    """Its blocks are still being written by the load: the tier must not copy them (a
    wrong block under a real hash), nor hold them past the load's own report."""
    side = SchedulerSide(CONFIG, BS, _host(8))
    side.request_finished(_request("a", 3 * BS + 1), [7, 8, 9, 10])
    _step(side)
    _done(side, sending={"a"})
    loading = _request("b", 3 * BS + 1, computed=0)
    side.get_num_new_matched_tokens(loading, 0)
    side.update_state_after_alloc(loading, _alloc([20, 21, 22, 23]), 3 * BS)
    _step(side)
    loading.block_hashes = [_h(2000 + i) for i in range(3)]  # as if other blocks: unsaved
    loading.num_computed_tokens = 3 * BS  # vLLM counts them computed before they land
    assert side.request_finished(loading, [20, 21, 22, 23]) == (False, None)  # aborted
    assert _step(side).tier_saves == {}
    _done(side, recving={"b"})
    loading.request_id = "b-again"
    assert side.request_finished(loading, [20, 21, 22, 23])[0] is True  # not loading: saved


def test_an_aborted_request_that_was_matched_but_never_allocated_unpins() -> None:
    """vLLM found no room for it, then it was aborted: ``request_finished`` comes with
    no blocks, and its matched slots must not stay pinned (the tier would shrink)."""
    side = SchedulerSide(CONFIG, BS, _host(8))
    side.request_finished(_request("a", 3 * BS + 1), [7, 8, 9, 10])
    _step(side)
    _done(side, sending={"a"})
    waiting = _request("w", 3 * BS + 1, computed=0)
    assert side.get_num_new_matched_tokens(waiting, 0) == (3 * BS, True)
    assert side.request_finished(waiting, []) == (False, None)
    tiers = side.tiers
    assert tiers is not None
    host = tiers.index("host")
    assert host is not None and host._pins == {} and tiers._matched == {}
