"""The planner: its decision on constructed inputs (``plan``: each branch), and the
whole loop on simulated workers (``pdserve sim-worker`` backends over gRPC, switched
by the router's ``RoleSwitcher``) under a simulated load with a clock of its own: a
load shift moves the roles within a bounded time, steady load never flaps."""

from __future__ import annotations

import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
from prometheus_client import CollectorRegistry
from unit.fakes import Clock
from unit.sim_cluster import start_sim_worker

from pdserve.core.types import Role
from pdserve.router.cluster.planner_loop import PlannerLoop
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.planner import (
    Demand,
    PlannerConfig,
    PlannerDecision,
    PlannerInputs,
    PlannerState,
    Split,
    best_split,
    median_cost,
    plan,
)
from pdserve.router.dispatch.policies.slo import SloConfig
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import StepCost
from pdserve.worker.sim.engine import SimConfig

# A CPU engine's shape: 40 ms decode step, +1 ms per sequence, 1 ms per prompt token.
COST = StepCost(0.040, 0.001, 0.001, True, True)
CONFIG = PlannerConfig(mode="on", interval_s=5, window_s=30, hold_s=10, cooldown_s=30)
ITL_S = 0.2  # so short prompts (80 tokens: one 0.12 s step) fit it, long ones do not
SHORT_HEAVY = Demand(long_tokens_per_s=0, short_tokens_per_s=160, output_tokens_per_s=190)
LONG_HEAVY = Demand(long_tokens_per_s=700, short_tokens_per_s=40, output_tokens_per_s=60,
                    max_long_tokens=1500)


def decide(current: Split, demand: Demand, state: PlannerState | None = None,
           now: float = 100.0, cost: StepCost | None = COST
           ) -> tuple[PlannerDecision, PlannerState]:
    return plan(CONFIG, state or PlannerState(), PlannerInputs(current, demand, cost, ITL_S),
                now)


# ---- the decision on constructed inputs ----------------------------------------------


def test_nothing_moves_before_any_step_is_measured_or_without_load() -> None:
    for cost, demand, why in ((None, SHORT_HEAVY, "no step measured yet"),
                              (COST, Demand(), "no load")):
        decision, state = decide(Split(1, 1), demand, cost=cost)
        assert (decision.move, decision.desired, decision.reason) == (None, Split(1, 1), why)
        assert state.pending is None


def test_short_heavy_load_wants_every_worker_decoding_long_heavy_wants_a_prefill() -> None:
    assert best_split(2, SHORT_HEAVY, COST, ITL_S, CONFIG).split == Split(0, 2)
    long = best_split(2, LONG_HEAVY, COST, ITL_S, CONFIG)
    assert long.split == Split(1, 1) and long.holds_slos
    # Without a prefill worker, long prompts are prefilled on decode: the ITL breaks.
    assert not best_split(1, LONG_HEAVY, COST, ITL_S, CONFIG).holds_slos
    assert best_split(3, LONG_HEAVY, COST, ITL_S, CONFIG).split.num_prefill >= 1
    # More decode workers share the output: each one's gaps shrink.
    wide = best_split(3, SHORT_HEAVY, COST, ITL_S, CONFIG)
    assert wide.split == Split(0, 3) and wide.holds_slos


def test_decode_engines_that_chunk_prefill_can_take_long_prompts_within_the_itl() -> None:
    # Whole, a 1,500-token prompt is one 1.54 s step on decode: 7.7x the ITL objective.
    whole = best_split(2, LONG_HEAVY, COST, ITL_S, CONFIG)
    assert whole.split == Split(1, 1)
    # In chunks of 100 tokens, each step is 0.141 s: within it, and two decode workers
    # share the prompts with more headroom than one prefill worker has.
    chunked = best_split(2, LONG_HEAVY, COST, ITL_S, CONFIG, chunk_tokens=100)
    assert chunked.split == Split(0, 2) and chunked.holds_slos
    assert chunked.decode == pytest.approx(COST.seconds(1, 100) / ITL_S)


def test_a_better_split_must_hold_before_a_worker_moves_then_the_cooldown_applies() -> None:
    first, state = decide(Split(1, 1), SHORT_HEAVY, now=100)
    assert (first.move, first.desired, first.reason) == (None, Split(0, 2), "holding")
    held, state = decide(Split(1, 1), SHORT_HEAVY, state, now=100 + CONFIG.hold_s)
    assert (held.move, held.reason) == ("to_decode", "better split held")
    assert state.last_switch_s == 110 and state.pending is None
    # A shift right after: it waits out the cooldown even once it has held.
    back, state = decide(Split(0, 2), LONG_HEAVY, state, now=115)
    assert back.move is None and back.desired == Split(1, 1)
    back, state = decide(Split(0, 2), LONG_HEAVY, state, now=130)
    assert (back.move, back.reason) == (None, "cooling down")
    back, state = decide(Split(0, 2), LONG_HEAVY, state, now=110 + CONFIG.cooldown_s)
    assert back.move == "to_prefill"


def test_a_small_gain_is_not_worth_a_switch_and_a_lapse_resets_the_hold() -> None:
    current = best_split(3, SHORT_HEAVY, COST, ITL_S, CONFIG)
    decision, _ = decide(current.split, SHORT_HEAVY)
    assert decision.move is None and decision.reason == "current split is best"
    _, state = decide(Split(1, 1), SHORT_HEAVY, now=100)
    _, state = decide(Split(1, 1), LONG_HEAVY, state, now=105)  # the better split lapsed
    assert state.pending is None
    again, state = decide(Split(1, 1), SHORT_HEAVY, state, now=108)
    assert again.reason == "holding" and state.pending_since_s == 108


def test_the_cluster_cost_is_each_terms_median_over_the_engines_that_measured_it() -> None:
    prefill_only = StepCost(0.5, 0.5, 0.002, False, True)
    decodes = [StepCost(0.04, 0.001, 0.0, True, False), StepCost(0.05, 0.001, 0.0, True,
                                                                 False)]
    cost = median_cost([prefill_only, *decodes])
    assert cost is not None and (cost.base_s, cost.per_token_s) == (0.05, 0.002)
    assert median_cost(decodes) is None  # no engine computed a prompt yet


def test_config_refuses_bad_values() -> None:
    for bad in (dict(mode="auto"), dict(interval_s=0), dict(min_gain=1.0), dict(min_decode=0)):
        with pytest.raises(ValueError):
            PlannerConfig(**bad)


# ---- the loop on simulated workers ---------------------------------------------------


@dataclass
class Mix:
    rate: float  # requests per second
    long_share: float
    short_tokens: int = 80
    long_tokens: int = 1500
    short_out: int = 96
    long_out: int = 16


SHORTS = Mix(rate=2.0, long_share=0.0)
LONGS = Mix(rate=0.6, long_share=0.8)


@contextlib.asynccontextmanager
async def sim_cluster(num_prefill: int, num_decode: int
                      ) -> AsyncIterator[tuple[WorkerPool, list[grpc.aio.Server]]]:
    """Simulated workers (the CPU engine's cost model) in a router's pool."""
    servers: list[grpc.aio.Server] = []
    endpoints: dict[Role, list[str]] = {"prefill": [], "decode": []}
    prefills: list[Role] = ["prefill"] * num_prefill
    decodes: list[Role] = ["decode"] * num_decode
    for i, role in enumerate(prefills + decodes):
        server, port, _ = await start_sim_worker(SimConfig(
            role=role, worker_id=f"sim-{i}", prefill_s_per_token=COST.per_token_s,
            decode_s_per_token=COST.base_s))
        servers.append(server)
        endpoints[role].append(f"127.0.0.1:{port}")
    pool = WorkerPool(prefill=endpoints["prefill"], decode=endpoints["decode"])
    await pool.refresh_all()
    try:
        yield pool, servers
    finally:
        await pool.close()
        for server in servers:
            await server.stop(None)


async def simulate(pool: WorkerPool, phases: list[tuple[float, Mix]], seed: int = 7
                   ) -> list[tuple[float, Split]]:
    """Drive the planner loop through ``phases`` (seconds, mix) of simulated time: each
    second's arrivals (Poisson, the mix's prompt sizes), each request ending after its
    output at the step time of the decode worker's batch; every ``interval_s`` the
    planner decides and may switch a worker (a real ``SetRole`` on a simulated worker).
    Returns the roles after every decision."""
    rng = random.Random(seed)
    clock = Clock(0.0)
    demand = DemandWindow(CONFIG.window_s, clock)
    loop = PlannerLoop(CONFIG, pool, RoleSwitcher(pool), demand, SloConfig(itl_s=ITL_S),
                       CollectorRegistry(), clock)
    running: list[tuple[float, int]] = []  # (end time, output tokens)
    history: list[tuple[float, Split]] = []
    t_end = 0.0
    for seconds, mix in phases:
        t_end += seconds
        while clock.now < t_end:
            clock.now += 1.0
            for _ in range(_poisson(rng, mix.rate)):
                long = rng.random() < mix.long_share
                demand.on_arrival(mix.long_tokens if long else mix.short_tokens)
                out = mix.long_out if long else mix.short_out
                num_decode = max(len(pool.decode), 1)
                batch = max(demand.num_inflight / num_decode, 1)
                running.append((clock.now + out * COST.seconds(round(batch), 0), out))
            for done in [r for r in running if r[0] <= clock.now]:
                running.remove(done)
                demand.on_finished(done[1])
            if clock.now % CONFIG.interval_s == 0:
                await loop.step()
                history.append((clock.now, Split(len(pool.prefill), len(pool.decode))))
    return history


def _poisson(rng: random.Random, rate: float) -> int:
    n, t = 0, rng.expovariate(rate)
    while t < 1.0:
        n += 1
        t += rng.expovariate(rate)
    return n


def _changes(history: list[tuple[float, Split]]) -> list[tuple[float, Split]]:
    return [(t, s) for (t, s), (_, before) in zip(history[1:], history, strict=False)
            if s != before]


async def test_a_load_shift_moves_the_roles_within_a_bounded_time() -> None:
    async with sim_cluster(1, 2) as (pool, _):
        history = await simulate(pool, [(120, SHORTS), (180, LONGS)])
    changes = _changes(history)
    # Short-heavy: the prefill worker becomes a decode worker (after the hold).
    assert changes and changes[0][1] == Split(0, 3)
    assert changes[0][0] <= CONFIG.window_s + CONFIG.hold_s + 2 * CONFIG.interval_s
    # Long-heavy from t=120: a decode worker becomes a prefill worker, bounded by the
    # window filling with the new mix, the hold, and the cooldown.
    shifted = [(t, s) for t, s in changes if t > 120]
    assert shifted and shifted[0][1].num_prefill >= 1
    assert shifted[0][0] - 120 <= CONFIG.window_s + CONFIG.hold_s + CONFIG.cooldown_s
    assert history[-1][1].num_prefill >= 1 and history[-1][1].num_decode >= 1


async def test_steady_load_never_flaps() -> None:
    # Far from any boundary, and near one: three workers where one prefill worker runs
    # at ~0.85 utilisation, on the edge of its limit, so Poisson noise crosses it.
    cases = [((1, 1), SHORTS), ((1, 1), LONGS), ((1, 1), Mix(rate=1.0, long_share=0.3)),
             ((1, 2), Mix(rate=0.7, long_share=0.8))]
    for (num_prefill, num_decode), mix in cases:
        async with sim_cluster(num_prefill, num_decode) as (pool, _):
            history = await simulate(pool, [(600, mix)], seed=11)
        assert len(history) == 600 / CONFIG.interval_s  # it decided all along
        changes = _changes(history)
        # At most the first adaptation, then nothing: no switch back and forth.
        assert len(changes) <= 1, (mix, changes)
