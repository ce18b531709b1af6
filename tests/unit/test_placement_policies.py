"""``round_robin`` and ``least_loaded`` as pure functions of worker snapshots, and the
policy registry (``cache_aware`` and the prefix index are in ``test_placement.py``)."""

from __future__ import annotations

import pytest

from pdserve.router.dispatch.policies.placement import (
    Choice,
    LeastLoadedPlacement,
    Placement,
    RoundRobinPlacement,
    create_placement,
)
from pdserve.router.dispatch.workers.state import WorkerLoad, WorkerState

# ---- placement policies (pure functions) ------------------------------------------------------


def ws(role: str, i: int, healthy: bool = True, compat: str = "a", assigned: int = 0,
       waiting: int = 0, kv: float = 0.0) -> WorkerState:
    return WorkerState(endpoint=f"{role}-{i}", role=role, healthy=healthy,
                       compatibility_hash=compat, num_assigned=assigned,
                       load=WorkerLoad(num_waiting_reqs=waiting, kv_cache_usage=kv))


def workers(role: str, n: int) -> list[WorkerState]:
    return [ws(role, i) for i in range(n)]


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_without_healthy_decode_is_none(
    policy: Placement,
) -> None:
    assert policy.choose(workers("prefill", 1), [ws("decode", 0, healthy=False)], 0) is None
    assert policy.choose(workers("prefill", 1), [], 0) is None


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_skips_unhealthy_workers(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, healthy=False), ws("prefill", 1, assigned=5)]
    decode = [ws("decode", 0, assigned=5), ws("decode", 1, healthy=False)]
    for cursor in range(4):
        assert policy.choose(prefill, decode, cursor) == Choice(1, 0)


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_without_healthy_prefill_is_decode_alone(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, healthy=False)]
    assert policy.choose(prefill, workers("decode", 1), 0) == Choice(None, 0)
    assert policy.choose([], workers("decode", 1), 0) == Choice(None, 0)


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_pairs_only_compatible_workers(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, compat="b"), ws("prefill", 1, compat="a", assigned=9)]
    assert policy.choose(prefill, workers("decode", 1), 0) == Choice(1, 0)
    assert policy.choose(prefill[:1], workers("decode", 1), 0) == Choice(None, 0)


def test_round_robin_rotates_with_the_cursor() -> None:
    policy = RoundRobinPlacement()
    prefill, decode = workers("prefill", 2), workers("decode", 3)
    assert [policy.choose(prefill, decode, c) for c in range(6)] == [
        Choice(c % 2, c % 3) for c in range(6)]


def test_round_robin_rotates_over_healthy_workers_only() -> None:
    policy = RoundRobinPlacement()
    decode = [ws("decode", 0), ws("decode", 1, healthy=False), ws("decode", 2)]
    assert [policy.choose([], decode, c) for c in range(4)] == [
        Choice(None, i) for i in (0, 2, 0, 2)]


def test_least_loaded_picks_fewest_assigned_plus_waiting() -> None:
    policy = LeastLoadedPlacement()
    prefill = [ws("prefill", 0, assigned=1, waiting=1), ws("prefill", 1, waiting=1)]
    decode = [ws("decode", 0, assigned=2), ws("decode", 1, assigned=1),
              ws("decode", 2, waiting=3)]
    for cursor in range(3):
        assert policy.choose(prefill, decode, cursor) == Choice(1, 1)


def test_least_loaded_breaks_busy_ties_by_kv_usage() -> None:
    policy = LeastLoadedPlacement()
    decode = [ws("decode", 0, assigned=1, kv=0.9), ws("decode", 1, waiting=1, kv=0.2)]
    assert policy.choose([], decode, 0) == Choice(None, 1)


def test_least_loaded_breaks_ties_by_cursor() -> None:
    policy = LeastLoadedPlacement()
    prefill, decode = workers("prefill", 2), workers("decode", 3)
    assert [policy.choose(prefill, decode, c) for c in range(6)] == [
        Choice(c % 2, c % 3) for c in range(6)]
    # Among the tied, the first at or after the cursor (wrapping), not the lowest index.
    decode = [ws("decode", 0), ws("decode", 1, assigned=1), ws("decode", 2)]
    assert [policy.choose([], decode, c) for c in range(3)] == [
        Choice(None, i) for i in (0, 2, 2)]


def test_create_placement_by_name() -> None:
    assert isinstance(create_placement("round_robin"), RoundRobinPlacement)
    assert isinstance(create_placement("least_loaded"), LeastLoadedPlacement)
    assert create_placement("least_loaded").name == "least_loaded"


def test_create_placement_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="cache_awar.*least_loaded, round_robin"):
        create_placement("cache_awar")
