"""The KV tiers' policies under the real index: every policy keeps pinned blocks and
the slot cap; TTL expires; quotas keep one tenant from evicting another's whole set;
W-TinyLFU keeps a frequent block through a scan; the registry refuses unknown names
listing the valid ones, and the flag and the connector's config use it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from pdserve.cli.configs import up_config, worker_config
from pdserve.cli.flags import FLAGS
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.connector import TierSizes
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.policies.adaptive import DefaultPolicy, _bucket
from pdserve.kv_transfer.tiers.policies.lru import TtlPolicy
from pdserve.kv_transfer.tiers.policies.quota import QuotaPolicy
from pdserve.kv_transfer.tiers.policies.registry import make_policy, policy_names
from pdserve.kv_transfer.tiers.policies.tinylfu import TinyLfuPolicy
from pdserve.launch.up import plan

MODEL = ResolvedModel(Path("/models/tiny"), "tiny")

SPECS = ["lru", "wtinylfu", "wtinylfu-climb", "s3fifo", "default", "ttl", "ttl:5", "quota",
         "quota:lru", "doorkeeper", "doorkeeper:default"]


def _h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _index(spec: str, slots: int, clock: list[float] | None = None) -> TierIndex:
    t = clock if clock is not None else [0.0]
    return TierIndex(slots, make_policy(spec, slots), lambda: t[0])


def _save(index: TierIndex, keys: list[int], tenant: str | None = None) -> None:
    index.commit([slot for _, slot in index.reserve([_h(k) for k in keys], tenant)])


def test_every_policy_has_a_name_in_the_registry() -> None:
    assert {s.partition(":")[0] for s in SPECS} == set(policy_names())


@pytest.mark.parametrize("spec", SPECS)
def test_no_policy_evicts_a_pinned_block_or_grows_past_its_slots(spec: str) -> None:
    rng = random.Random(3)
    clock = [0.0]
    index = _index(spec, 16, clock)
    _save(index, [0])
    _save(index, [0])  # twice: a doorkeeper admits a block at its second want
    (kept,) = index.match([_h(0)])
    index.pin([kept])
    pinned: list[int] = []
    for step in range(3000):
        clock[0] = step * 0.001
        hashes = [_h(rng.randrange(1, 64)) for _ in range(rng.randrange(1, 6))]
        op = rng.random()
        if op < 0.5:
            slots = [s for _, s in index.reserve(hashes, rng.choice(["a", "b", None]))]
            (index.commit if rng.random() < 0.9 else index.discard)(slots)
        elif op < 0.8:
            got = index.match(hashes)
            index.pin(got)
            pinned += got
        elif pinned:
            index.unpin([pinned.pop(rng.randrange(len(pinned)))])
        assert len(index) <= 16
        assert len(set(index._held.values())) == len(index)
        if clock[0] < 5:  # ttl:5 may expire it; a pinned slot is still never rewritten
            assert index._held.get(_h(0)) == kept
    assert index.num_evictions > 0


@pytest.mark.parametrize("spec", SPECS)
def test_a_tier_whose_every_block_is_pinned_stores_nothing(spec: str) -> None:
    index = _index(spec, 3)
    _save(index, [1, 2, 3])
    index.pin(index.match([_h(1), _h(2), _h(3)]))
    assert index.reserve([_h(4)]) == []
    assert index.num_evictions == 0


def test_ttl_expires_blocks_and_frees_their_slots() -> None:
    clock = [0.0]
    index = _index("ttl:10", 4, clock)
    _save(index, [1, 2])
    clock[0] = 5.0
    _save(index, [3])
    assert index.lookup(_h(1)) is not None  # an access does not extend its life
    clock[0] = 10.5
    assert index.lookup(_h(1)) is None and index.lookup(_h(3)) is not None
    assert sorted(index.take_gone()) == sorted([_h(1), _h(2)])
    _save(index, [4, 5, 6])  # three freed slots: nothing evicted
    assert index.num_evictions == 0 and len(index) == 4


def test_a_pinned_block_that_expires_is_unmatchable_and_freed_once_unpinned() -> None:
    clock = [0.0]
    index = _index("ttl:1", 1, clock)
    _save(index, [1])
    slots = index.match([_h(1)])
    index.pin(slots)
    clock[0] = 2.0
    assert index.lookup(_h(1)) is None
    assert index.reserve([_h(2)]) == []  # its slot is still being read
    index.unpin(slots)
    assert len(index.reserve([_h(2)])) == 1


def test_one_tenant_cannot_evict_anothers_whole_working_set() -> None:
    lru, quota = _index("lru", 10), _index("quota:lru", 10)
    for index in (lru, quota):
        _save(index, list(range(10)), "a")
        for k in range(100, 200):  # b floods the tier
            _save(index, [k], "b")
    assert all(lru.lookup(_h(k)) is None for k in range(10))  # plain LRU: a is gone
    policy = quota.policy
    assert isinstance(policy, QuotaPolicy)
    assert policy.held_by("a") == 5 and policy.held_by("b") == 5
    assert sum(quota.lookup(_h(k)) is not None for k in range(10)) == 5


def test_wtinylfu_keeps_a_frequent_block_through_a_scan_lru_loses_it() -> None:
    kept = {}
    for spec in ("lru", "wtinylfu"):
        index = _index(spec, 20)
        for _ in range(10):
            _save(index, [0])
            index.lookup(_h(0))
        for k in range(1, 200):  # one-off blocks
            _save(index, [k])
        kept[spec] = index.lookup(_h(0)) is not None
    assert kept == {"lru": False, "wtinylfu": True}


def _far_reuse(index: TierIndex) -> int:
    """Ten blocks asked for again every round, 100 one-off blocks between in requests of
    five (a tier of 50 slots): hits."""
    hits = 0
    for r in range(40):
        hot = [_h(k) for k in range(10)]
        hits += len(index.match(hot))
        _save(index, list(range(10)))
        for start in range(1000 + 100 * r, 1100 + 100 * r, 5):
            _save(index, list(range(start, start + 5)))
    return hits


def test_a_large_tiers_shadows_see_a_sample_and_still_pick_s3fifo() -> None:
    index = _index("default", 5000)
    policy = index.policy
    assert isinstance(policy, DefaultPolicy)
    hot = list(range(200))
    hits = 0
    for r in range(12):
        hits += len(index.match([_h(k) for k in hot]))
        _save(index, hot)
        for start in range(10_000 + 5000 * r, 15_000 + 5000 * r, 5):
            _save(index, list(range(start, start + 5)))
    assert {shadow.capacity for shadow in policy._shadows} == {2500}  # rate 2
    assert all(_bucket(k) % 2 == 0 for shadow in policy._shadows for k in shadow.held)
    assert policy.leader == "s3fifo" and hits >= 200 * 6  # an LRU of 5,000 hits none


def _near_reuse(index: TierIndex) -> int:
    """Each block asked for twice, 50 blocks apart (a tier of 100 slots): hits."""
    hits = 0
    for i in range(2000):
        again = i - 50
        if again >= 0:
            hits += len(index.match([_h(again)]))
            _save(index, [again])
        _save(index, [i])
    return hits


def test_s3fifo_keeps_a_block_asked_for_again_past_lrus_reach_default_follows() -> None:
    hits = {spec: _far_reuse(_index(spec, 50)) for spec in ("lru", "s3fifo")}
    default = _index("default", 50)
    hits["default"] = _far_reuse(default)
    assert hits["lru"] == 0 and hits["s3fifo"] >= 10 * 37
    assert hits["default"] >= 0.9 * hits["s3fifo"]
    assert isinstance(default.policy, DefaultPolicy) and default.policy.leader == "s3fifo"


def test_where_lru_wins_default_follows_lru() -> None:
    hits = {spec: _near_reuse(_index(spec, 100)) for spec in ("lru", "s3fifo")}
    default = _index("default", 100)
    hits["default"] = _near_reuse(default)
    assert hits["lru"] == 1950 and hits["s3fifo"] < 0.5 * hits["lru"]
    assert hits["default"] >= 0.95 * hits["lru"]
    assert isinstance(default.policy, DefaultPolicy) and default.policy.leader == "lru"


def test_an_unknown_policy_lists_the_valid_ones() -> None:
    for bad in ("nope", "lru:3", "quota:nope", "ttl:abc"):
        with pytest.raises(ValueError) as err:
            make_policy(bad, 10)
        if bad in ("nope", "lru:3"):
            assert all(name in str(err.value) for name in policy_names())
    with pytest.raises(ValueError, match="valid policies"):
        ConnectorConfig(engine_id="w", kv_tier_policy="nope")
    flag = FLAGS["kv-tier-policy"]
    assert flag.default == "default"
    assert ConnectorConfig(engine_id="w").kv_tier_policy == "default"


def test_the_flag_reaches_both_tiers_from_up_and_from_the_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["up", "--kv-offload-gib", "0.5", "--num-prefill", "1",
                                      "--kv-tier-policy", "quota:ttl:30"])
    workers = [c for c in plan(up_config(args, MODEL), tmp_path) if c.name != "router"]
    assert len(workers) == 2
    for child in workers:
        connector = worker_config(build_parser().parse_args(child.argv[3:]),
                                  MODEL).engine.connector
        assert connector.kv_tier_policy == "quota:ttl:30"
    planner = TierSizes(host_slots=8, disk_slots=4).planner(connector, 16)
    assert planner is not None
    for tier in ("host", "disk"):
        index = planner.index(tier)
        assert index is not None and isinstance(index.policy, QuotaPolicy)
        assert isinstance(index.policy.inner, TtlPolicy) and index.policy.inner.ttl_s == 30
    monkeypatch.setenv("PDSERVE_KV_TIER_POLICY", "wtinylfu")
    env_args = build_parser().parse_args(["prefill"])
    connector = worker_config(env_args, MODEL).engine.connector
    assert connector.kv_tier_policy == "wtinylfu"
    planner = TierSizes(host_slots=8).planner(connector, 16)
    index = planner.index("host") if planner is not None else None
    assert index is not None and isinstance(index.policy, TinyLfuPolicy)
    monkeypatch.setenv("PDSERVE_KV_TIER_POLICY", "bogus")
    with pytest.raises(SystemExit):
        worker_config(build_parser().parse_args(["prefill"]), MODEL)
