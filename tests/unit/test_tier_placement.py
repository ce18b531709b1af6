"""Placement over the KV tiers and the cluster KV pool: the prefix index's tier entries
give each worker's tier match (never the prompt's last token), a tier or a peer's host
tier counts at its measured cost (priors before), the chosen prefill worker is told
which peer to pull from, and the metric says what it was expected to load."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

import pytest
from prometheus_client import CollectorRegistry
from unit.fake_worker import WorkerScript, start_fake_worker

from pdserve.core.block_hash import chain_hashes, tier_hashes
from pdserve.core.handle import PoolSource
from pdserve.core.types import PhaseRequest, SamplingSpec, WorkerLoadReport
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.load_plan import LoadPlan, loadable_tokens, plan_load
from pdserve.router.dispatch.policies.placement import CacheAwarePlacement, Choice, PlacementRequest
from pdserve.router.dispatch.policies.tier_cost import (
    DISK_PRIOR_RATIO,
    HOST_PRIOR_RATIO,
    NOT_MEASURED,
    POOL_PRIOR_RATIO,
    PRIOR_RATIOS,
    STORE_OVER_HOST,
    STORE_PRIOR_RATIO,
    KvLoadRates,
    TierRatios,
    load_rates,
    tier_ratios,
)
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import StepCost, WorkerLoad, WorkerState

BS = 16
PROMPT = list(range(1000, 1000 + 10 * BS + 5))  # 10 full blocks + 5 tokens
HASHES = chain_hashes(PROMPT, BS)
TIER_TOKENS = "pdserve:placement_tier_tokens_total"
COMPUTE_S = 1e-4  # seconds per prompt token, as a measured step fit says
DECODE = [WorkerState(endpoint="decode-0", role="decode", healthy=True, worker_id="decode-0",
                      compatibility_hash="a")]


def _approx(value: float) -> float:
    """``pytest.approx(value)``, typed as the float field it compares equal to."""
    return cast(float, pytest.approx(value))


def ws(i: int, tokens: int = 0, kv_port: int = 0, kv_load: KvLoadRates = NOT_MEASURED,
       compat: str = "a", healthy: bool = True) -> WorkerState:
    step = StepCost(0.0, 0.0, COMPUTE_S, True, True)
    return WorkerState(endpoint=f"prefill-{i}", role="prefill", healthy=healthy,
                       worker_id=f"prefill-{i}", compatibility_hash=compat,
                       kv_host=f"10.0.0.{i}", kv_port=kv_port, num_assigned=1 if tokens else 0,
                       num_assigned_tokens=tokens, load=WorkerLoad(step=step, kv_load=kv_load))


def index_with(holdings: dict[str, dict[str, int]], prompt: Sequence[int] = PROMPT
               ) -> PrefixIndex:
    """Worker id -> {"engine" | "host" | "disk": leading blocks of ``prompt`` held}."""
    index, hashes = PrefixIndex(), chain_hashes(prompt, BS)
    for worker, held in holdings.items():
        blocks = list(hashes[:held.get("engine", 0)])
        for tier in ("host", "disk"):
            blocks += tier_hashes(hashes[:held.get(tier, 0)], tier)
        index.replace(worker, BS, blocks)
    return index


def routed(holdings: dict[str, dict[str, int]], prefill: Sequence[WorkerState],
           registry: CollectorRegistry | None = None) -> tuple[PrefixRouting, PlacementRequest]:
    routing = PrefixRouting(index_with(holdings), registry or CollectorRegistry())
    return routing, routing.request(PROMPT, prefill)


def tier_samples(registry: CollectorRegistry) -> dict[str, float | None]:
    return {t: registry.get_sample_value(TIER_TOKENS, {"tier": t})
            for t in ("host", "disk", "pool")}


# ---- the index's tier entries ---------------------------------------------------------------


def test_tier_entries_give_tier_tokens_and_leave_engine_matches_alone() -> None:
    _, req = routed({"prefill-0": {"engine": 2, "host": 6, "disk": 9},
                     "prefill-1": {"disk": 4}}, [ws(0), ws(1)])
    assert req.matched_tokens == {"prefill-0": 2 * BS}
    assert req.tier_tokens == {"prefill-0": {"host": 6 * BS, "disk": 9 * BS},
                               "prefill-1": {"disk": 4 * BS}}
    # prefill-0: engine 2 blocks, then host to 6, then disk to 9; 1 block + 5 computed.
    assert req.load_plans["prefill-0"] == LoadPlan(
        4 * BS, 3 * BS, 0, round(4 * BS * HOST_PRIOR_RATIO + 3 * BS * DISK_PRIOR_RATIO
                                  + BS + 5))
    assert req.uncached_tokens(ws(0)) == req.load_plans["prefill-0"].cost_tokens


def test_no_tier_entries_give_the_request_of_before() -> None:
    _, req = routed({"prefill-0": {"engine": 7}}, [ws(0), ws(1, kv_port=5)])
    assert req == PlacementRequest(len(PROMPT), {"prefill-0": 7 * BS})
    assert req.uncached_tokens(ws(0)) == len(PROMPT) - 7 * BS


def test_tier_matches_stop_before_the_last_token() -> None:
    prompt = PROMPT[:4 * BS]  # exactly 4 blocks: the 4th holds the last token
    index = index_with({"prefill-0": {"engine": 4, "host": 4}, "prefill-1": {"host": 4}},
                       prompt)
    req = PrefixRouting(index, CollectorRegistry()).request(prompt, [ws(0), ws(1, kv_port=9)])
    assert loadable_tokens(len(prompt), BS) == 3 * BS and loadable_tokens(1, BS) == 0
    assert req.matched_tokens == {"prefill-0": 4 * BS}  # the engine match, as before
    assert req.tier_tokens == {"prefill-0": {"host": 3 * BS}, "prefill-1": {"host": 3 * BS}}
    assert "prefill-0" not in req.load_plans  # its engine holds more than any tier
    assert req.load_plans["prefill-1"].num_host_tokens == 3 * BS


def test_match_held_agrees_with_match() -> None:
    rng = random.Random(7)
    index = PrefixIndex()
    for w in range(6):
        held = [h for h in HASHES[:rng.randint(0, 10)] if rng.random() < 0.9]
        index.replace(f"w{w}", BS, held)
    assert index.match_held(HASHES) == index.match(HASHES)
    assert index.match_held([]) == {} and not index.is_held(tier_hashes(HASHES, "host")[0])


# ---- cost ------------------------------------------------------------------------------------


def test_unmeasured_sources_use_the_priors() -> None:
    assert PRIOR_RATIOS == TierRatios(HOST_PRIOR_RATIO, DISK_PRIOR_RATIO, POOL_PRIOR_RATIO,
                                      STORE_PRIOR_RATIO)
    assert 0 < HOST_PRIOR_RATIO < DISK_PRIOR_RATIO <= POOL_PRIOR_RATIO < 1
    assert HOST_PRIOR_RATIO < STORE_PRIOR_RATIO < 1
    assert load_rates(WorkerLoadReport()) is NOT_MEASURED
    assert tier_ratios(NOT_MEASURED, COMPUTE_S, BS) == PRIOR_RATIOS
    # Loads measured, compute not (no prefill timed): nothing to compare with.
    measured = KvLoadRates(host_s_per_block=1e-3)
    assert tier_ratios(measured, None, BS) == PRIOR_RATIOS
    # Host measured: its ratio; disk and pool stay at their priors; the store (its prior
    # below) at least STORE_OVER_HOST times the host's: here dearer than computing.
    host = 1e-3 / BS / COMPUTE_S
    assert tier_ratios(measured, COMPUTE_S, BS) == TierRatios(
        _approx(host), DISK_PRIOR_RATIO, POOL_PRIOR_RATIO,
        _approx(STORE_OVER_HOST * host))


def test_measured_rates_from_the_load_report() -> None:
    report = WorkerLoadReport(
        kv_tier_load_blocks=10, kv_tier_load_time_ns=2_000_000, kv_tier_load_bytes=10_000,
        kv_disk_load_blocks=4, kv_disk_load_time_ns=8_000_000,
        kv_bytes_received=1_000_000, kv_transfer_time_ns=5_000_000)
    rates = load_rates(report)
    assert rates == KvLoadRates(_approx(2e-4), _approx(2e-3), None,
                                _approx(5e-9), 1000.0)
    ratios = tier_ratios(rates, COMPUTE_S, BS)
    per_token = 1 / (BS * COMPUTE_S)
    # The pool, not measured, at the P/D pull bandwidth times a block's bytes.
    assert ratios == TierRatios(_approx(2e-4 * per_token), _approx(2e-3 * per_token),
                                _approx(5e-9 * 1000 * per_token))
    pooled = load_rates(WorkerLoadReport(kv_pool_load_blocks=2, kv_pool_load_time_ns=6_400_000))
    assert tier_ratios(pooled, COMPUTE_S, BS).pool == pytest.approx(2.0)


def test_plan_orders_engine_host_disk_pool_and_skips_a_dear_pool() -> None:
    cheap = TierRatios(0.0, 0.5, 0.25)
    assert plan_load(165, 32, 64, 48, 128, cheap) == LoadPlan(32, 0, 64, 16 + 37)
    dear = TierRatios(0.0, 0.5, 1.5)
    assert plan_load(165, 32, 64, 48, 128, dear) == LoadPlan(32, 0, 0, 101)


# ---- placement -------------------------------------------------------------------------------


def test_a_host_tier_holder_wins_over_an_idle_equal_worker() -> None:
    prefill = [ws(0, kv_port=7), ws(1, kv_port=7), ws(2, kv_port=7)]
    _, req = routed({"prefill-1": {"host": 10}}, prefill)
    for cursor in range(3):
        assert CacheAwarePlacement().choose(prefill, DECODE, cursor, req) == Choice(1, 0)
    assert req.uncached_tokens(prefill[1]) == round(10 * BS * HOST_PRIOR_RATIO) + 5
    # The others could pull it from prefill-1 (the pool), at the pool's prior.
    assert req.uncached_tokens(prefill[0]) == round(10 * BS * POOL_PRIOR_RATIO) + 5
    assert req.pool_source(prefill[1]) is None


def test_pool_source_for_a_worker_without_the_prefix() -> None:
    registry = CollectorRegistry()
    # prefill-1's host tier holds the prefix, prefill-2's some of it; both are busy.
    prefill = [ws(0, kv_port=7), ws(1, tokens=2000, kv_port=8), ws(2, tokens=2000, kv_port=9)]
    routing, req = routed({"prefill-1": {"host": 10}, "prefill-2": {"host": 3}}, prefill,
                          registry)
    choice = CacheAwarePlacement().choose(prefill, DECODE, 0, req)
    assert choice == Choice(0, 0)
    source = req.pool_source(prefill[0])
    assert source == PoolSource("10.0.0.1", 8, 10, "prefill-1")
    # prefill-2 pulls the blocks it lacks from prefill-1 too (its own host tier first).
    assert req.load_plans["prefill-2"] == LoadPlan(
        3 * BS, 0, 7 * BS, round(3 * BS * HOST_PRIOR_RATIO + 7 * BS * POOL_PRIOR_RATIO + 5),
        source)
    # No peer with a KV port, or an unhealthy one, or another model: no pool.
    for peer in (ws(1, tokens=2000), ws(1, tokens=2000, kv_port=8, healthy=False),
                 ws(1, tokens=2000, kv_port=8, compat="b")):
        _, other = routed({"prefill-1": {"host": 10}}, [ws(0), peer])
        assert other.pool_source(ws(0)) is None
    assert tier_samples(registry) == {"host": 0.0, "disk": 0.0, "pool": 0.0}
    routing.on_placed(req, prefill[0])
    assert tier_samples(registry) == {"host": 0.0, "disk": 0.0, "pool": 10.0 * BS}


@pytest.mark.parametrize(("puller", "holder"), [("none", "int8"), ("int8", "fp8"),
                                                ("lossless", "none"), ("fp8", "lossless")])
def test_no_pool_pull_is_planned_between_workers_whose_kv_compression_differs(
        puller: str, holder: str) -> None:
    prefill = [replace(ws(0, kv_port=7), kv_compression=puller),
               replace(ws(1, tokens=2000, kv_port=8), kv_compression=holder)]
    _, req = routed({"prefill-1": {"host": 10}}, prefill)
    assert req.pool_source(prefill[0]) is None
    assert "prefill-0" not in req.load_plans
    # The same encoding on both: planned (so the check above can fail).
    prefill[1] = replace(prefill[1], kv_compression=puller)
    _, req = routed({"prefill-1": {"host": 10}}, prefill)
    assert req.pool_source(prefill[0]) == PoolSource("10.0.0.1", 8, 10, "prefill-1")


def test_a_slow_measured_pool_is_not_used() -> None:
    # Pulling a block took 2x computing it on prefill-0.
    slow = KvLoadRates(pool_s_per_block=2 * BS * COMPUTE_S)
    prefill = [ws(0, kv_port=7, kv_load=slow), ws(1, tokens=2000, kv_port=8)]
    _, req = routed({"prefill-1": {"host": 10}}, prefill)
    assert CacheAwarePlacement().choose(prefill, DECODE, 0, req) == Choice(0, 0)
    assert req.pool_source(prefill[0]) is None
    assert req.uncached_tokens(prefill[0]) == len(PROMPT)
    # Measured fast: used.
    fast = KvLoadRates(pool_s_per_block=0.1 * BS * COMPUTE_S)
    prefill[0] = ws(0, kv_port=7, kv_load=fast)
    _, req = routed({"prefill-1": {"host": 10}}, prefill)
    assert req.pool_source(prefill[0]) == PoolSource("10.0.0.1", 8, 10, "prefill-1")
    assert req.uncached_tokens(prefill[0]) == round(0.1 * 10 * BS) + 5


def test_tier_metric_series_exist_at_zero() -> None:
    registry = CollectorRegistry()
    PrefixRouting(PrefixIndex(), registry)
    assert tier_samples(registry) == {"host": 0.0, "disk": 0.0, "pool": 0.0}


# ---- the prefill worker and the dispatcher ---------------------------------------------------


def test_prefill_passes_the_pool_source_to_its_connector() -> None:
    source = PoolSource("10.0.0.1", 8, 10, "prefill-1")
    for max_tokens, params in ((1, {"pool": source.to_params()}),
                               (8, {"do_remote_decode": True, "pool": source.to_params()})):
        req = PhaseRequest("r", "prefill", tuple(PROMPT), SamplingSpec(max_tokens=max_tokens),
                           pool_source=source)
        assert PrefillPolicy().engine_params(req).kv_transfer_params == params


_NO_REQUEST = PlacementRequest()


class _Fixed:
    """A placement that always picks the first prefill worker."""

    name = "fixed"

    def choose(self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState],
               cursor: int, request: PlacementRequest = _NO_REQUEST) -> Choice | None:
        return Choice(0, 0)


async def test_dispatch_sends_the_pool_source_with_the_prefill() -> None:
    p0 = await start_fake_worker("prefill", WorkerScript(kv_port=7001))
    p1 = await start_fake_worker("prefill", WorkerScript(kv_port=7002))
    d0 = await start_fake_worker("decode")
    pool = WorkerPool([p0.endpoint, p1.endpoint], [d0.endpoint])
    # The pool orders its workers by id: the placement picks the first, the other holds.
    chosen, holder = (p0, p1) if pool.prefill[0].info.grpc_endpoint == p0.endpoint else (p1, p0)
    registry = CollectorRegistry()
    routing = PrefixRouting(index_with({holder.servicer.worker_id: {"host": 10}}), registry)
    dispatcher = PDDispatcher(pool, _Fixed(), registry, 10.0, routing,
                              DisaggConfig(mode="always"))
    try:
        await pool.refresh_all()
        chunks = [c async for c in dispatcher.generate("r1", PROMPT, SamplingSpec(max_tokens=3))]
        assert sum(len(c.token_ids) for c in chunks) == 3
        (sent,) = [g for g in chosen.servicer.generates if g.phase == "prefill"]
        assert sent.pool_source == PoolSource("127.0.0.1", holder.servicer.script.kv_port, 10,
                                              holder.servicer.worker_id)
        assert tier_samples(registry)["pool"] == 10 * BS
    finally:
        await pool.close()
        for w in (p0, p1, d0):
            await w.stop()
