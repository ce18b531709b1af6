"""Pending blocks in the prefix index: a prefill placed on a worker makes its
prompt's blocks count as held there until the worker's KV events confirm them,
the prefill fails, the worker drops them, or they expire (injectable clock, no
sleeps); a cap bounds them. And the placement they steer: a second request with
the same new prefix goes to the worker computing it, unless it is much more
loaded."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from unit.fakes import Clock

from pdserve.core.block_hash import chain_hashes
from pdserve.router.dispatch.policies.placement import CacheAwarePlacement, Choice, PlacementRequest
from pdserve.router.dispatch.prefix.index import PrefixIndex, PrefixMatch
from pdserve.router.dispatch.prefix.pending import PendingConfig
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.workers.state import WorkerState

BS = 16
PROMPT = list(range(5000, 5000 + 10 * BS + 5))  # 10 full blocks + 5 tokens
HASHES = chain_hashes(PROMPT, BS)
DECODE = [WorkerState("decode-0", "decode", healthy=True, worker_id="decode-0")]


def prefill(i: int, assigned: int = 0, tokens: int = 0) -> WorkerState:
    return WorkerState(f"p{i}", "prefill", healthy=True, worker_id=f"p{i}",
                       num_assigned=assigned, num_assigned_tokens=tokens)


def indexed(clock: Clock | None = None, config: PendingConfig | None = None) -> PrefixIndex:
    """An index where p0 and p1 are known (empty, block size BS)."""
    index = PrefixIndex(config, clock or Clock())
    for w in ("p0", "p1"):
        index.replace(w, BS, ())
    return index


def test_pending_blocks_count_as_held_on_their_worker_only() -> None:
    index = indexed()
    index.add_pending("p1", HASHES)
    assert index.match_blocks(HASHES) == PrefixMatch({"p1": 10}, {"p1": 10})
    assert index.match(HASHES[:4]) == {"p1": 4}
    # Held blocks are not pending: a prefix held and a suffix in flight.
    index.replace("p0", BS, HASHES[:6])
    assert index.add_pending("p0", HASHES) == tuple(HASHES[6:])
    assert index.match_blocks(HASHES) == PrefixMatch({"p0": 10, "p1": 10}, {"p0": 4, "p1": 10})


def test_pending_entry_steers_a_second_request_to_the_same_worker() -> None:
    routing, policy = PrefixRouting(indexed(), CollectorRegistry()), CacheAwarePlacement()
    first = routing.request(PROMPT)
    assert first.matched_tokens == {}
    p = [prefill(0), prefill(1)]
    assert policy.choose(p, DECODE, 1, first) == Choice(1, 0)
    placed = routing.on_placed(first, p[1])
    assert placed is not None and placed.block_hashes == tuple(HASHES)
    # The first prefill is in flight on p1 (its uncached tokens queued there).
    p = [prefill(0), prefill(1, assigned=1, tokens=len(PROMPT))]
    second = routing.request(PROMPT)
    assert second.matched_tokens == second.pending_tokens == {"p1": 10 * BS}
    for cursor in range(4):
        assert policy.choose(p, DECODE, cursor, second) == Choice(1, 0)
    # Without the pending entry p0 (idle) would have won.
    assert policy.choose(p, DECODE, 0, PlacementRequest(len(PROMPT))) == Choice(0, 0)


def test_a_much_more_loaded_computing_worker_spills() -> None:
    request = PlacementRequest(len(PROMPT), {"p1": 10 * BS}, {"p1": 10 * BS})
    policy = CacheAwarePlacement()
    light = [prefill(0), prefill(1, assigned=1, tokens=len(PROMPT))]
    # The queued prefix is shared, not added: 5 uncached + 5 queued + one request's cost.
    assert policy.cost(light[1], request) == 5 + 5 + 128
    # Another request queued there (each costs ``request_cost_tokens``) outweighs
    # computing this short prefix on idle p0.
    heavy = [prefill(0), prefill(1, assigned=2, tokens=len(PROMPT) + 40)]
    assert policy.cost(heavy[1], request) == 5 + 45 + 2 * 128 > policy.cost(heavy[0], request)
    assert policy.choose(heavy, DECODE, 0, request) == Choice(0, 0)
    # The credit never exceeds what is queued (the prefill finished, no event yet).
    assert policy.cost(prefill(1), request) == 5


def test_stored_event_confirms_a_pending_block() -> None:
    index = indexed()
    index.add_pending("p0", HASHES)
    index.apply("p0", False, HASHES[:3], ())
    assert index.pending.blocks_of("p0") == set(HASHES[3:])
    assert index.match_blocks(HASHES) == PrefixMatch({"p0": 10}, {"p0": 7})
    index.apply("p0", False, HASHES[3:], ())
    assert len(index.pending) == 0
    assert index.match_blocks(HASHES) == PrefixMatch({"p0": 10}, {})


def test_failed_prefill_drops_its_pending_blocks_unless_shared() -> None:
    routing = PrefixRouting(indexed(), CollectorRegistry())
    first = routing.on_placed(routing.request(PROMPT), prefill(0))
    other = list(range(9000, 9000 + 3 * BS))
    second = routing.on_placed(routing.request(PROMPT + other), prefill(0))
    routing.on_prefill_failed(first)
    # The second prefill still computes the same prefix (and its own tail).
    assert routing.index.match(HASHES) == {"p0": 10}
    routing.on_prefill_failed(second)
    assert routing.index.match(HASHES) == {} and len(routing.index.pending) == 0
    routing.on_prefill_failed(None)  # a prefill placed on an unindexed worker


def test_pending_blocks_expire_after_the_ttl() -> None:
    clock, registry = Clock(), CollectorRegistry()
    routing = PrefixRouting(indexed(clock, PendingConfig(ttl_s=30.0)), registry)
    routing.on_placed(routing.request(PROMPT), prefill(0))
    clock.now += 29.9
    assert routing.index.match(HASHES) == {"p0": 10}
    routing.on_placed(routing.request(PROMPT[:3 * BS]), prefill(1))
    clock.now += 0.2
    assert routing.index.match(HASHES) == {"p1": 3}  # p0's expired, p1's not yet
    clock.now += 30.0
    assert routing.index.match(HASHES) == {}
    assert routing.index.pending.num_expired == 13
    routing.on_placed(routing.request(PROMPT[:BS]), prefill(0))  # exports the metrics
    assert registry.get_sample_value("pdserve:prefix_pending_expired_total") == 13
    assert registry.get_sample_value("pdserve:prefix_pending_blocks") == 1


def test_a_refreshed_entry_lives_another_ttl() -> None:
    clock = Clock()
    index = indexed(clock, PendingConfig(ttl_s=10.0))
    index.add_pending("p0", HASHES[:2])
    clock.now += 8
    index.add_pending("p0", HASHES[:1])
    clock.now += 8
    assert index.match(HASHES) == {"p0": 1}


def test_pending_entries_are_capped_oldest_first() -> None:
    index = indexed(config=PendingConfig(max_entries=4))
    index.add_pending("p0", HASHES[:3])
    index.add_pending("p1", HASHES[:3])
    assert len(index.pending) == 4 and index.pending.num_evicted == 2
    assert index.pending.blocks_of("p0") == {HASHES[2]}
    assert index.match(HASHES) == {"p1": 3}


@pytest.mark.parametrize("how", ["removed", "cleared", "remove_worker", "resync"])
def test_worker_dropping_blocks_drops_their_pending_entries(how: str) -> None:
    index = indexed()
    index.add_pending("p0", HASHES)
    index.add_pending("p1", HASHES)
    if how == "removed":
        index.apply("p0", False, (), HASHES[4:])
        assert index.match(HASHES) == {"p0": 4, "p1": 10}
        return
    if how == "cleared":
        index.apply("p0", True, (), ())
    elif how == "remove_worker":
        index.remove_worker("p0")
    else:
        index.replace("p0", BS, HASHES[:2])
    held = 2 if how == "resync" else 0
    assert index.pending.blocks_of("p0") == set()
    assert index.match_blocks(HASHES) == PrefixMatch(
        {"p1": 10, **({"p0": held} if held else {})}, {"p1": 10})


def test_pending_config_is_validated() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        PendingConfig(ttl_s=0)
    with pytest.raises(ValueError, match="max_entries"):
        PendingConfig(max_entries=0)
