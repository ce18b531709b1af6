"""The host tier without an engine: its index (LRU, pins, hard cap), its memory (a
save then a load gives the same bytes; a slot that no longer holds its block, or
whose bytes changed, loads nothing), and the scheduler side's plan: which blocks a
finished request saves, which a new request loads, and that the ids coming back
from the worker unpin, commit or forget the right slots.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.host_tier import HostTier, num_slots
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.scheduler_side import SchedulerSide
from pdserve.kv_transfer.tier_index import TierIndex
from pdserve.kv_transfer.wire import TransferError

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
    tier.slot_views(2)[3].view(-1)[7] += 1.0  # one value of one layer flips
    before = [layer[5].clone() for layer in kv]
    with pytest.raises(TransferError, match="checksum"):
        tier.load([2], [5], [_h(1)])
    assert all(torch.equal(layer[5], b) for layer, b in zip(kv, before, strict=True))


# ---- the scheduler side's plan --------------------------------------------------------

def _request(req_id: str, num_tokens: int, computed: int | None = None) -> Any:
    hashes = [_h(1000 + i) for i in range(num_tokens // BS)]
    return SimpleNamespace(request_id=req_id, kv_transfer_params=None,
                           num_tokens=num_tokens, block_hashes=hashes,
                           num_computed_tokens=num_tokens if computed is None else computed,
                           use_structured_output=False)


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
    side = SchedulerSide(CONFIG, BS, tier_slots=8)
    held, params = side.request_finished(_request("a", 3 * BS + 40), [7, 8, 9, 10])
    assert (held, params) == (True, None)
    save = _step(side).tier_saves["a"]
    assert save.block_ids == (7, 8, 9) and len(save.slots) == 3  # the partial block stays
    # half-computed (aborted mid-prefill): only what was computed
    # aborted mid-prefill: only what was computed (one block, which a is writing)
    held, _ = side.request_finished(_request("b", 5 * BS, computed=BS + 3), [1, 2, 3, 4, 5])
    assert _step(side).tier_saves == {} and held is False


def test_a_new_request_loads_what_the_engine_lost_from_the_tier() -> None:
    side = SchedulerSide(CONFIG, BS, tier_slots=8)
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
    assert side.loads_from_tier("a2")
    _done(side, recving={"a2"})
    assert not side.loads_from_tier("a2")


def test_never_the_last_token_and_a_failed_load_forgets_its_blocks() -> None:
    side = SchedulerSide(CONFIG, BS, tier_slots=8)
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
    side = SchedulerSide(CONFIG, BS, tier_slots=2)
    side.request_finished(_request("a", 2 * BS + 1), [7, 8, 9])
    _step(side)
    _done(side, sending={"a"})
    waiting = _request("w", 2 * BS + 1, computed=0)
    assert side.get_num_new_matched_tokens(waiting, 0) == (2 * BS, True)
    side.update_state_after_alloc(waiting, _alloc([]), 0)  # vLLM took none of it
    assert side.tier is not None and side.tier._pins == {}
    off = SchedulerSide(CONFIG, BS)
    assert off.request_finished(_request("a", 2 * BS + 1), [7, 8, 9]) == (False, None)
    assert off.get_num_new_matched_tokens(_request("b", 2 * BS + 1, 0), 0) == (0, False)
    assert _step(off).tier_saves == {} and off.tier is None
