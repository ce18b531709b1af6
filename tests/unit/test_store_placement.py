"""Placement over the cluster KV store (``--kv-store``): a block one worker announced to
the store (a ``pdserve:store`` KV event, in the store tier's namespace) is loadable by
every worker naming the same store and KV layout in its Health, at the store's cost
(cheaper than computing, dearer than the worker's own host tier); not by a worker
without it; not past the store's lifetime; not after the announcer's weights changed;
never under another salt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest
from prometheus_client import CollectorRegistry
from unit.fake_worker import WorkerScript, start_fake_worker

from pdserve.core.block_hash import KV_TIERS, chain_hashes, salt_root, tier_hashes
from pdserve.core.kv_store_id import kv_store_id
from pdserve.core.types import SamplingSpec, WorkerHealth
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.tiers.plan import EVENT_MEDIUM
from pdserve.proto import convert
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.load_plan import LoadPlan, plan_load
from pdserve.router.dispatch.policies.placement import CacheAwarePlacement, Choice
from pdserve.router.dispatch.policies.tier_cost import (
    HOST_PRIOR_RATIO,
    NOT_MEASURED,
    PRIOR_RATIOS,
    STORE_OVER_HOST,
    STORE_PRIOR_RATIO,
    KvLoadRates,
    TierRatios,
    tier_ratios,
)
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import StepCost, WorkerLoad, WorkerState
from pdserve.worker.engine import EngineConfig
from pdserve.worker.host import EngineHost
from pdserve.worker.vllm.kv_events import VllmEventTranslator

BS = 16
PROMPT = list(range(5000, 5000 + 10 * BS + 5))  # 10 full blocks + 5 tokens
HASHES = chain_hashes(PROMPT, BS)
STORE = kv_store_id("redis://store-0:6379/0")
TTL_S = 100.0
COMPUTE_S = 1e-4  # seconds per prompt token, as a measured step fit says
TIER_TOKENS = "pdserve:placement_tier_tokens_total"
DECODE = [WorkerState(endpoint="decode-0", role="decode", healthy=True, worker_id="decode-0",
                      compatibility_hash="a")]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ws(name: str, store: str = STORE, compat: str = "a", role: str = "prefill",
       ttl_s: float = TTL_S) -> WorkerState:
    step = StepCost(0.0, 0.0, COMPUTE_S, True, True)
    return WorkerState(endpoint=name, role=role, healthy=True, worker_id=name,
                       compatibility_hash=compat, kv_store_id=store,
                       kv_store_ttl_s=ttl_s if store else 0.0, load=WorkerLoad(step=step))


def announce(index: PrefixIndex, worker: str, blocks: Sequence[int] = HASHES[:10]) -> None:
    """``worker`` published ``blocks`` to the store: its ``pdserve:store`` stored event."""
    if index.block_size(worker) is None:
        index.replace(worker, BS, ())
    index.apply(worker, False, tier_hashes(blocks, "store"), ())


def store_tokens(routing: PrefixRouting, prefill: Sequence[WorkerState],
                 others: Sequence[WorkerState] = (), salt: str | None = None) -> dict[str, int]:
    req = routing.request(PROMPT, prefill, salt, others)
    return {w: plan.num_store_tokens for w, plan in req.load_plans.items()
            if plan.num_store_tokens}


def test_a_prefix_announced_by_a_is_loaded_from_the_store_by_b() -> None:
    registry = CollectorRegistry()
    index = PrefixIndex()
    index.replace("a", BS, HASHES[:10])  # a computed the prefix (its engine holds it)
    announce(index, "a")  # and published it
    routing = PrefixRouting(index, registry)
    prefill = [ws("a"), ws("b")]
    req = routing.request(PROMPT, prefill)
    assert index.blocks_of("b") == set()  # b never computed or held any of it
    assert req.tier_tokens == {"a": {"store": 10 * BS}, "b": {"store": 10 * BS}}
    assert "a" not in req.load_plans  # its engine holds as much: nothing to load
    assert req.load_plans["b"] == LoadPlan(0, 0, 0, round(10 * BS * STORE_PRIOR_RATIO) + 5,
                                           num_store_tokens=10 * BS)
    assert req.uncached_tokens(prefill[1]) < len(PROMPT)
    before = registry.get_sample_value(TIER_TOKENS, {"tier": "store"})
    routing.on_placed(req, prefill[1])
    assert before == 0.0
    assert registry.get_sample_value(TIER_TOKENS, {"tier": "store"}) == 10 * BS


def test_store_blocks_load_after_the_own_tiers_and_cost_more_than_the_host_tier() -> None:
    index = PrefixIndex()
    announce(index, "a")
    index.replace("b", BS, tier_hashes(HASHES[:4], "host"))
    announce(index, "b", HASHES[:2])
    plan = PrefixRouting(index, None).request(PROMPT, [ws("a"), ws("b")]).load_plans["b"]
    assert (plan.num_host_tokens, plan.num_store_tokens) == (4 * BS, 6 * BS)
    assert plan.cost_tokens == round(4 * BS * HOST_PRIOR_RATIO + 6 * BS * STORE_PRIOR_RATIO + 5)
    assert HOST_PRIOR_RATIO < STORE_PRIOR_RATIO < 1
    # engine 1, host 2, disk 3, store 6, pool 8 blocks: each source extends the run.
    assert plan_load(165, 16, 32, 48, 128, PRIOR_RATIOS, store=96) == LoadPlan(
        16, 16, 32, round(16 * 0.05 + 16 * 0.5 + 48 * STORE_PRIOR_RATIO + 32 * 0.5 + 37),
        num_store_tokens=48)
    dear = TierRatios(store=1.0)  # as dear as computing: not used
    assert plan_load(165, 0, 0, 0, 0, dear, store=96) == LoadPlan(0, 0, 0, 165)


def test_a_measured_store_costs_its_measurement_never_below_twice_the_host_tier() -> None:
    per_token = 1 / (BS * COMPUTE_S)
    fast = KvLoadRates(store_s_per_block=3e-4)  # 0.1875 of computing a block
    assert tier_ratios(fast, COMPUTE_S, BS).store == pytest.approx(3e-4 * per_token)
    with_host = KvLoadRates(host_s_per_block=4e-4, store_s_per_block=3e-4)
    assert tier_ratios(with_host, COMPUTE_S, BS).store == pytest.approx(
        STORE_OVER_HOST * 4e-4 * per_token)
    faster = KvLoadRates(store_s_per_block=1e-5)  # below twice the host tier's prior
    assert tier_ratios(faster, COMPUTE_S, BS).store == STORE_OVER_HOST * HOST_PRIOR_RATIO
    slow = KvLoadRates(store_s_per_block=2 * BS * COMPUTE_S)  # 2x computing: not used
    assert tier_ratios(slow, COMPUTE_S, BS).store == pytest.approx(2.0)
    assert tier_ratios(NOT_MEASURED, COMPUTE_S, BS).store == STORE_PRIOR_RATIO


def test_the_store_run_joins_every_announcer_of_the_store_decode_included() -> None:
    index = PrefixIndex()
    announce(index, "a", HASHES[:4])
    announce(index, "decode-1", HASHES[4:8])  # a decode worker published the next blocks
    routing = PrefixRouting(index, None)
    decode = [ws("decode-1", role="decode")]
    assert store_tokens(routing, [ws("a"), ws("b")], decode) == {"a": 8 * BS, "b": 8 * BS}
    # Without the decode worker's snapshot its announcements are not known to be the store's.
    assert store_tokens(routing, [ws("a"), ws("b")]) == {"a": 4 * BS, "b": 4 * BS}


def test_a_worker_without_the_store_gets_no_store_plan() -> None:
    index = PrefixIndex()
    announce(index, "a")
    routing = PrefixRouting(index, None)
    other_store = kv_store_id("redis://store-1:6379/0")
    prefill = [ws("a"), ws("none", store=""), ws("elsewhere", store=other_store),
               ws("other-model", compat="b"), ws("b")]
    assert store_tokens(routing, prefill) == {"a": 10 * BS, "b": 10 * BS}
    # The announcer without a store in its Health: its events are no store's blocks.
    assert store_tokens(routing, [ws("a", store=""), ws("b")]) == {}


def test_a_worker_of_another_kv_compression_gets_no_store_plan() -> None:
    index = PrefixIndex()
    announce(index, "a")  # a publishes int8 blocks: their names say so
    routing = PrefixRouting(index, None)
    prefill = [replace(ws("a"), kv_compression="int8"), ws("raw"),
               replace(ws("b"), kv_compression="int8")]
    assert store_tokens(routing, prefill) == {"a": 10 * BS, "b": 10 * BS}


def test_store_entries_expire_after_the_store_lifetime() -> None:
    clock = Clock()
    index = PrefixIndex(clock=clock)
    announce(index, "a")
    routing = PrefixRouting(index, None)
    prefill = [ws("a"), ws("b")]
    clock.now = TTL_S - 1
    index.replace("a", BS, index.blocks_of("a"))  # a resync re-announces: no new lifetime
    assert store_tokens(routing, prefill) == {"a": 10 * BS, "b": 10 * BS}
    clock.now = TTL_S
    assert store_tokens(routing, prefill) == {}
    assert not index.is_held(tier_hashes(HASHES[:1], "store")[0])  # forgotten
    index.replace("a", BS, tier_hashes(HASHES[:10], "store"))  # a resync does not revive it
    assert store_tokens(routing, prefill) == {}
    announce(index, "a", HASHES[:3])  # published again: fresh
    assert store_tokens(routing, prefill) == {"a": 3 * BS, "b": 3 * BS}
    # The shortest lifetime any worker of the store reports bounds it.
    clock.now = TTL_S + 20
    assert store_tokens(routing, [ws("a"), ws("b", ttl_s=10.0)]) == {}


def test_a_weight_drop_forgets_the_store_announcements() -> None:
    index = PrefixIndex()
    announce(index, "a")
    announce(index, "c", HASHES[:2])
    routing = PrefixRouting(index, None)
    prefill = [ws("a"), ws("b"), ws("c")]
    assert store_tokens(routing, prefill)["b"] == 10 * BS
    index.apply("a", True, (), ())  # a's weights changed: its cache cleared
    assert store_tokens(routing, prefill) == {w: 2 * BS for w in ("a", "b", "c")}
    index.apply("c", False, (), tier_hashes(HASHES[:2], "store"))  # or removals
    assert store_tokens(routing, prefill) == {}


def test_a_salted_prompt_does_not_match_unsalted_store_blocks() -> None:
    index = PrefixIndex()
    announce(index, "a")
    routing = PrefixRouting(index, None)
    prefill = [ws("a"), ws("b")]
    assert store_tokens(routing, prefill, salt="tenant-1") == {}
    salted = chain_hashes(PROMPT, BS, salt_root("tenant-1"))
    announce(index, "a", salted[:5])
    assert store_tokens(routing, prefill, salt="tenant-1") == {"a": 5 * BS, "b": 5 * BS}
    assert store_tokens(routing, prefill, salt="tenant-2") == {}
    assert store_tokens(routing, prefill) == {"a": 10 * BS, "b": 10 * BS}


def test_store_events_pass_the_worker_unchanged_under_their_own_medium() -> None:
    assert "store" in KV_TIERS and EVENT_MEDIUM["store"] == "pdserve:store"
    names = tier_hashes(HASHES[:3], "store")
    assert not set(names) & (set(HASHES) | set(tier_hashes(HASHES[:3], "host")))

    class BlockStored:  # vLLM's event, by class name and fields
        block_hashes = names
        medium = EVENT_MEDIUM["store"]

    assert VllmEventTranslator(BS).translate([BlockStored()]) == (False, names, [])


def test_the_store_id_names_the_store_not_its_secrets() -> None:
    plain = kv_store_id("redis://store-0:6379/0")
    assert kv_store_id(None) == kv_store_id("") == ""
    assert kv_store_id("redis://admin:hunter2@STORE-0:6379/0") == plain
    assert "hunter2" not in kv_store_id("redis://admin:hunter2@store-0:6379/0")
    assert kv_store_id("redis://store-0:6379/0?socket_timeout=1") == plain
    assert kv_store_id("redis://store-0:6380/0") != plain
    assert kv_store_id("redis://store-0:6379/1") != plain
    assert (kv_store_id("redis-cluster://b:1,a:1") == kv_store_id("redis-cluster://a:1,b:1")
            != kv_store_id("redis://a:1,b:1"))


async def test_dispatch_places_on_the_worker_that_loads_from_the_store() -> None:
    p0 = await start_fake_worker("prefill")
    p1 = await start_fake_worker("prefill")
    d0 = await start_fake_worker("decode", WorkerScript(kv_store_id=STORE, kv_store_ttl_s=TTL_S))
    pool = WorkerPool([p0.endpoint, p1.endpoint], [d0.endpoint])
    # The pool orders its workers by id: the second is on the store (a tie: the first).
    without, on_store = ((p0, p1) if pool.prefill[0].info.grpc_endpoint == p0.endpoint
                         else (p1, p0))
    on_store.servicer.script.kv_store_id, on_store.servicer.script.kv_store_ttl_s = STORE, TTL_S
    registry = CollectorRegistry()
    index = PrefixIndex()
    announce(index, d0.servicer.worker_id)  # decode published the prefix
    dispatcher = PDDispatcher(pool, CacheAwarePlacement(), registry, 10.0,
                              PrefixRouting(index, registry), DisaggConfig(mode="always"))
    try:
        await pool.refresh_all()
        chunks = [c async for c in dispatcher.generate("r1", PROMPT, SamplingSpec(max_tokens=3))]
        assert sum(len(c.token_ids) for c in chunks) == 3
        assert [g.phase for g in on_store.servicer.generates] == ["prefill"]
        assert not without.servicer.generates
        assert registry.get_sample_value(TIER_TOKENS, {"tier": "store"}) == 10 * BS
    finally:
        await pool.close()
        for w in (p0, p1, d0):
            await w.stop()


def test_placement_prefers_the_store_worker_over_an_equal_one_without() -> None:
    index = PrefixIndex()
    announce(index, "decode-0")
    prefill = [ws("none", store=""), ws("b")]
    decode = [ws("decode-0", role="decode")]
    req = PrefixRouting(index, None).request(PROMPT, prefill, None, decode)
    for cursor in range(3):
        assert CacheAwarePlacement().choose(prefill, decode, cursor, req) == Choice(1, 0)
    assert DECODE[0].kv_store_id == ""


def test_a_worker_health_names_its_store_and_lifetime_not_its_url() -> None:
    def health(connector: ConnectorConfig) -> WorkerHealth:
        cfg = EngineConfig(model_path="/m", served_model_name="m", role="prefill",
                           connector=connector, dtype="float32")
        return EngineHost(cfg, "w0", PrefillPolicy(), lambda c, n: None).health()  # type: ignore[arg-type, return-value]

    on_store = health(ConnectorConfig(engine_id="w0", kv_store="redis://pdserve@store-0:6379/0",
                                      kv_store_ttl_s=60.0))
    assert (on_store.kv_store_id, on_store.kv_store_ttl_s) == (STORE, 60.0)
    assert "store-0" not in str(convert.health_to_pb(on_store))
    off = health(ConnectorConfig(engine_id="w0"))
    assert (off.kv_store_id, off.kv_store_ttl_s) == ("", 0.0)
