"""Placement policies on constructed states (pure functions), and the prefix index
that feeds ``cache_aware``: ties, an overloaded holder, a removed worker, an empty
index."""

from __future__ import annotations

import copy

import pytest
from prometheus_client import CollectorRegistry

from pdserve.core.block_hash import chain_hashes
from pdserve.router.dispatch.policies.placement import (
    PLACEMENTS,
    CacheAwareConfig,
    CacheAwarePlacement,
    Choice,
    LeastLoadedPlacement,
    PlacementRequest,
    RoundRobinPlacement,
    create_placement,
)
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.workers.state import WorkerLoad, WorkerState

BS = 16
PROMPT = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks + 5 tokens


def ws(role: str, i: int, healthy: bool = True, compat: str = "a", assigned: int = 0,
       tokens: int = 0, waiting: int = 0, running: int = 0, kv: float = 0.0) -> WorkerState:
    return WorkerState(endpoint=f"{role}-{i}", role=role, healthy=healthy,
                       worker_id=f"{role}-{i}", compatibility_hash=compat,
                       num_assigned=assigned, num_assigned_tokens=tokens,
                       load=WorkerLoad(num_running_reqs=running, num_waiting_reqs=waiting,
                                       kv_cache_usage=kv))


def prefills(n: int) -> list[WorkerState]:
    return [ws("prefill", i) for i in range(n)]


def routing(index: PrefixIndex) -> PrefixRouting:
    return PrefixRouting(index, CollectorRegistry())


def index_with(holdings: dict[str, int]) -> PrefixIndex:
    """Worker id -> how many leading blocks of PROMPT it holds."""
    index = PrefixIndex()
    hashes = chain_hashes(PROMPT, BS)
    for worker, n in holdings.items():
        index.replace(worker, BS, hashes[:n])
    return index


def _chosen(choice: Choice | None) -> Choice:
    """The choice a policy made (these tests give it workers it can place on)."""
    assert choice is not None
    return choice


# ---- prefix index ---------------------------------------------------------------------------


def test_chain_hashes_name_prefixes() -> None:
    a = chain_hashes(PROMPT, BS)
    b = chain_hashes(PROMPT[:3 * BS] + [7] + PROMPT[3 * BS + 1:], BS)
    assert len(a) == 10 and len(set(a)) == 10
    assert a[:3] == b[:3] and all(x != y for x, y in zip(a[3:], b[3:], strict=True))
    assert chain_hashes(PROMPT[:BS - 1], BS) == []
    with pytest.raises(ValueError, match="block_size"):
        chain_hashes(PROMPT, 0)


def test_match_counts_leading_blocks_only() -> None:
    hashes = chain_hashes(PROMPT, BS)
    index = PrefixIndex()
    index.replace("p0", BS, hashes[:6])
    index.replace("p1", BS, hashes[:2] + hashes[3:10])  # block 2 evicted: match stops there
    assert index.match(hashes) == {"p0": 6, "p1": 2}
    assert index.match(chain_hashes([5] + PROMPT[1:], BS)) == {}
    index.apply("p0", False, stored=hashes[6:8], removed=hashes[5:6])
    assert index.match(hashes)["p0"] == 5
    index.apply("p0", True, stored=hashes[:1], removed=())  # cleared, then one stored
    assert index.match(hashes) == {"p0": 1, "p1": 2}


def test_removed_worker_leaves_no_entries() -> None:
    index = index_with({"p0": 10, "p1": 4})
    index.remove_worker("p0")
    assert index.match(chain_hashes(PROMPT, BS)) == {"p1": 4}
    assert index.workers() == ["p1"] and index.num_blocks == 4
    index.remove_worker("p1")
    assert index.num_blocks == 0 and index.match(chain_hashes(PROMPT, BS)) == {}


def test_routing_request_in_tokens() -> None:
    req = routing(index_with({"prefill-1": 7})).request(PROMPT)
    assert req == PlacementRequest(len(PROMPT), {"prefill-1": 7 * BS})


# ---- cache_aware ----------------------------------------------------------------------------


def test_cache_aware_prefers_the_holder() -> None:
    req = routing(index_with({"prefill-1": 8, "prefill-2": 3})).request(PROMPT)
    for cursor in range(4):
        assert CacheAwarePlacement().choose(prefills(3), [ws("decode", 0)], cursor, req) == \
            Choice(1, 0)


def test_cache_aware_ties_rotate_with_the_cursor() -> None:
    req = routing(index_with({"prefill-0": 5, "prefill-1": 5})).request(PROMPT)
    policy = CacheAwarePlacement()
    chosen = [_chosen(policy.choose(prefills(3), [ws("decode", 0)], c, req)).prefill
              for c in range(4)]
    assert chosen == [0, 1, 0, 0]  # cursor 2 points at prefill-2, which holds nothing


def test_cache_aware_tie_on_cost_goes_to_fewer_queued() -> None:
    # Same cost: p0 holds 4 blocks more but has one queued request of 64 tokens.
    policy = CacheAwarePlacement(CacheAwareConfig(request_cost_tokens=0))
    req = PlacementRequest(200, {"prefill-0": 64})
    prefill = [ws("prefill", 0, assigned=1, tokens=64), ws("prefill", 1)]
    assert policy.cost(prefill[0], req) == policy.cost(prefill[1], req) == 200
    assert policy.choose(prefill, [ws("decode", 0)], 0, req) == Choice(1, 0)


def test_cache_aware_spills_from_an_overloaded_holder() -> None:
    req = PlacementRequest(640, {"prefill-0": 635})  # 5 uncached tokens on the holder
    policy = CacheAwarePlacement(CacheAwareConfig(request_cost_tokens=128))
    light = [ws("prefill", 0, assigned=2, tokens=10), ws("prefill", 1)]
    assert policy.cost(light[0], req) == 5 + 10 + 2 * 128
    assert _chosen(policy.choose(light, [ws("decode", 0)], 0, req)).prefill == 0
    # The holder's queue (prefill work + per-request cost) now exceeds computing it all.
    heavy = [ws("prefill", 0, assigned=3, tokens=300), ws("prefill", 1)]
    assert _chosen(policy.choose(heavy, [ws("decode", 0)], 0, req)).prefill == 1
    # The engine's own queue counts even when this router sent nothing.
    busy = [ws("prefill", 0, waiting=4, running=1), ws("prefill", 1)]
    assert _chosen(policy.choose(busy, [ws("decode", 0)], 0, req)).prefill == 1
    # ... and both busy: back to the holder.
    both = [busy[0], ws("prefill", 1, waiting=4, running=1)]
    assert _chosen(policy.choose(both, [ws("decode", 0)], 0, req)).prefill == 0


def test_cache_aware_ignores_a_removed_worker_still_in_the_index() -> None:
    index = index_with({"prefill-0": 10, "prefill-1": 2})
    req = routing(index).request(PROMPT)
    prefill = [ws("prefill", 1), ws("prefill", 2)]  # prefill-0 left the pool
    assert CacheAwarePlacement().choose(prefill, [ws("decode", 0)], 1, req) == Choice(0, 0)
    index.remove_worker("prefill-1")
    req = routing(index).request(PROMPT)
    assert req.matched_tokens == {"prefill-0": 10 * BS}
    # Nothing left that helps: the least loaded one.
    prefill = [ws("prefill", 1, assigned=1, tokens=5), ws("prefill", 2)]
    assert CacheAwarePlacement().choose(prefill, [ws("decode", 0)], 0, req) == Choice(1, 0)


def test_cache_aware_with_an_empty_index_balances_load() -> None:
    req = routing(PrefixIndex()).request(PROMPT)
    assert req == PlacementRequest(len(PROMPT), {})
    policy = CacheAwarePlacement()
    prefill = [ws("prefill", 0, assigned=1, tokens=100), ws("prefill", 1),
               ws("prefill", 2, running=1)]
    assert policy.choose(prefill, [ws("decode", 0)], 0, req) == Choice(1, 0)
    assert [_chosen(policy.choose(prefills(2), [ws("decode", 0)], c, req)).prefill
            for c in range(4)] == [0, 1, 0, 1]


def test_cache_aware_decode_by_load_then_free_kv_and_compatibility() -> None:
    req = PlacementRequest(len(PROMPT), {"prefill-0": 32})
    prefill = [ws("prefill", 0, compat="b"), ws("prefill", 1)]
    decode = [ws("decode", 0, assigned=1), ws("decode", 1, kv=0.7), ws("decode", 2, kv=0.2),
              ws("decode", 3, compat="b", kv=0.0)]
    # prefill-0 holds more but is compatible only with decode-3, which is idle: fine.
    assert CacheAwarePlacement().choose(prefill, decode, 0, req) == Choice(0, 3)
    decode[3] = ws("decode", 3, compat="c")
    assert CacheAwarePlacement().choose(prefill, decode, 0, req) == Choice(1, 2)
    assert CacheAwarePlacement().choose([], decode, 0, req) == Choice(None, 3)
    assert CacheAwarePlacement().choose(prefill, [ws("decode", 0, healthy=False)], 0,
                                        req) is None


def test_cache_aware_decode_goes_to_the_holder_of_the_conversation() -> None:
    # decode-1's cache holds 10 blocks of the prompt (a conversation's earlier turns),
    # learnt from its KV events like any worker's.
    req = routing(index_with({"decode-1": 10})).request(PROMPT)
    assert req.decode_cached_tokens(ws("decode", 1)) == 10 * BS
    policy = CacheAwarePlacement()
    prefill = [ws("prefill", 0)]
    busier = [ws("decode", 0), ws("decode", 1, running=1, kv=0.5)]
    assert policy.choose(prefill, busier, 0, req) == Choice(0, 1)  # busier, but holds it
    # Each request running there costs decode_request_cost_tokens: 160 cached tokens
    # outweigh one more request (128) than elsewhere, not two (256).
    one_more = [ws("decode", 0, running=1), ws("decode", 1, running=2)]
    assert policy.choose(prefill, one_more, 0, req) == Choice(0, 1)
    assert policy.choose(prefill, [ws("decode", 0), ws("decode", 1, running=2)], 0,
                         req) == Choice(0, 0)
    # Local prompt tokens already sent to it count as work queued there too.
    assert policy.choose(prefill, [ws("decode", 0), ws("decode", 1, tokens=200)], 0,
                         req) == Choice(0, 0)
    # A holder not compatible with the chosen prefill, or unhealthy, is not a candidate.
    for holder in (ws("decode", 1, compat="b"), ws("decode", 1, healthy=False)):
        assert policy.choose(prefill, [ws("decode", 0, running=3), holder], 0,
                             req) == Choice(0, 0)
    # Nobody holds any of it: least loaded, as before (no cost, KV usage breaks ties).
    fresh = routing(index_with({"prefill-0": 10})).request(PROMPT)
    assert policy.choose(prefill, [ws("decode", 0, kv=0.3), ws("decode", 1, kv=0.1)], 0,
                         fresh) == Choice(0, 1)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_decisions_are_pure(name: str) -> None:
    policy = create_placement(name)
    req = routing(index_with({"prefill-1": 6})).request(PROMPT)
    prefill = [ws("prefill", 0, assigned=1, tokens=30), ws("prefill", 1), ws("prefill", 2)]
    decode = [ws("decode", 0, kv=0.5), ws("decode", 1)]
    before = copy.deepcopy((prefill, decode, req))
    first = [policy.choose(prefill, decode, c, req) for c in range(5)]
    assert [policy.choose(prefill, decode, c, req) for c in range(5)] == first
    assert (prefill, decode, req) == before


def test_policies_accept_a_request_and_default_without_one() -> None:
    prefill, decode = prefills(2), [ws("decode", 0)]
    for policy in (RoundRobinPlacement(), LeastLoadedPlacement(), CacheAwarePlacement()):
        assert policy.choose(prefill, decode, 1) == Choice(1, 0)


def test_placement_names_and_validation() -> None:
    assert create_placement("cache_aware").name == "cache_aware"
    with pytest.raises(ValueError, match="valid placements: cache_aware, least_loaded, "
                                         "round_robin"):
        create_placement("nearest")
    with pytest.raises(ValueError, match="request_cost_tokens"):
        CacheAwareConfig(request_cost_tokens=-1)
