"""Runs the planner (``planner.py``) in the router: measures the demand, decides every
``interval_s``, flips one worker's role through the ``RoleSwitcher`` when the decision
says so (mode ``on``), and exports what it aims at
(``pdserve:planner_desired_replicas{role}``: with mode ``export`` the chart's KEDA
autoscaler acts on it).

Only the elected router decides (``pdserve.membership.Election``: one leader among the
candidate replicas on etcd; with static membership the router with ``--planner on``);
the others measure their load and wait. ``pdserve:planner_leader`` says which leads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Gauge

from pdserve.core.tasks import cancel_and_wait
from pdserve.core.types import Role
from pdserve.membership import Election, StaticElection
from pdserve.router.cluster.errors import ClusterError
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.planner import (
    Demand,
    PlannerConfig,
    PlannerDecision,
    PlannerInputs,
    PlannerState,
    Split,
    SplitLoad,
    median_cost,
    plan,
)
from pdserve.router.dispatch.policies.slo import DERIVED_ITL_FACTOR, SloConfig
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool
from pdserve.router.dispatch.workers.state import StepCost
from pdserve.router.metrics import PREFIX, counter, gauge

logger = logging.getLogger("pdserve.router.planner")
Clock = Callable[[], float]


class PlannerMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.desired = gauge(
            registry, f"{PREFIX}planner_desired_replicas", "Workers per role the planner "
            "aims at (for an autoscaler; on one machine it flips roles to get there)",
            ["role"])
        self.utilization = gauge(
            registry, f"{PREFIX}planner_estimated_utilization", "The planner's estimate "
            "of each role's utilisation under the current split (1: saturated)", ["role"])
        self.moves = counter(
            registry, f"{PREFIX}planner_role_switches", "Role switches the planner made, "
            "by the role a worker was switched to", ["role"])
        self.leader = gauge(
            registry, f"{PREFIX}planner_leader", "1 in the router replica whose planner "
            "decides (the elected leader, once it decided in its term: its "
            "planner_desired_replicas are current), 0 in the others")
        for role in ("prefill", "decode"):
            self.desired.labels(role)
            self.utilization.labels(role)
            self.moves.labels(role)

    def on_decision(self, decision: PlannerDecision) -> None:
        self.desired.labels("prefill").set(decision.desired.num_prefill)
        self.desired.labels("decode").set(decision.desired.num_decode)
        if decision.current_load is not None:
            self.utilization.labels("prefill").set(decision.current_load.prefill)
            self.utilization.labels("decode").set(decision.current_load.decode)


class PlannerLoop:
    """``start`` runs the loop (modes ``on``, ``export``); ``step`` is one decision, or
    ``None`` while another router leads (tests drive it with their own clock).
    ``election`` is owned by the caller (started and closed there); by default this
    router leads iff the planner is enabled."""

    def __init__(self, config: PlannerConfig, pool: WorkerPool, switcher: RoleSwitcher,
                 demand: DemandWindow, slo: SloConfig | None = None,
                 registry: CollectorRegistry | None = None, clock: Clock = time.monotonic,
                 election: Election | None = None) -> None:
        self.config = config
        self._pool = pool
        self._switcher = switcher
        self.demand = demand
        self._slo = slo or SloConfig()
        self._clock = clock
        self.election = election or StaticElection(config.enabled)
        self._metrics = PlannerMetrics(registry)
        if isinstance(self._metrics.leader, Gauge):  # read at each scrape: never stale
            self._metrics.leader.set_function(lambda: float(self.leading))
        self._state = PlannerState()
        self._task: asyncio.Task[None] | None = None
        self.last: PlannerDecision | None = None

    @property
    def leading(self) -> bool:
        """This router's planner decides, and its last decision is of this term."""
        return self.election.is_leader and self.last is not None

    def inputs(self) -> PlannerInputs:
        placeable = [w for w in self._pool.all if w.snapshot().healthy]
        current = Split(sum(w.role == "prefill" for w in placeable),
                        sum(w.role == "decode" for w in placeable))
        costs = [s.load.step for s in (w.snapshot() for w in placeable)
                 if s.load.step is not None]
        cost = median_cost(costs)
        if cost is None:
            return PlannerInputs(current, Demand(), None)
        scale = self.config.demand_scale  # this router sees 1/scale of the requests
        batch = max(scale * self.demand.num_inflight / max(current.num_decode, 1), 1.0)
        itl_s = self._slo.itl_s or DERIVED_ITL_FACTOR * cost.seconds(1, 0)
        caps = [w.snapshot().prefill_chunk_tokens for w in placeable]
        chunk = 0 if not caps or 0 in caps else min(caps)
        demand = self.demand.demand(_too_long(cost, batch, itl_s, chunk)).scaled(scale)
        return PlannerInputs(current, demand, cost, itl_s, chunk)

    async def step(self) -> PlannerDecision | None:
        if not self.election.is_leader:
            if self.last is not None:  # a new term starts afresh: no hold carried over
                logger.info("planner: not leading (another router decides)")
            self._state, self.last = PlannerState(), None
            return None
        inputs = self.inputs()
        decision, self._state = plan(self.config, self._state, inputs, self._clock())
        if self.last is None or decision.reason != self.last.reason:
            logger.info("planner: %s (current %s, desired %s; estimated load %s; demand "
                        "%s)", decision.reason, _fmt_split(inputs.current),
                        _fmt_split(decision.desired), _fmt(decision.current_load),
                        _fmt_demand(inputs))
        self.last = decision
        self._metrics.on_decision(decision)
        if decision.move is not None and self.config.switches_roles:
            await self._move(decision)
        return decision

    async def _move(self, decision: PlannerDecision) -> None:
        to: Role = "prefill" if decision.move == "to_prefill" else "decode"
        worker = self._pick(to)
        if worker is None:
            return
        worker_id = worker.snapshot().worker_id
        logger.info("planner: %s -> %s (estimated utilisation now %s, then %s)", worker_id,
                    to, _fmt(decision.current_load), _fmt(decision.desired_load))
        try:
            await self._switcher.switch(worker_id, to, self.config.drain_timeout_s)
        except ClusterError as exc:
            logger.warning("planner: switching %s to %s failed: %s", worker_id, to,
                           exc.message)
            return
        self._metrics.moves.labels(to).inc()

    def _pick(self, to: Role) -> Worker | None:
        """The least busy healthy worker of the other role."""
        source = self._pool.decode if to == "prefill" else self._pool.prefill
        candidates = [w for w in source if w.snapshot().healthy]
        if not candidates:
            return None
        return min(candidates, key=lambda w: (w.snapshot().num_assigned,
                                              w.snapshot().num_assigned_tokens))

    def start(self) -> None:
        if self.config.enabled and self._task is None:
            self._task = asyncio.create_task(self._run(), name="pdserve-planner")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the planner must outlive a bad sample
                logger.exception("planner step failed")


def _too_long(cost: StepCost, batch: float, itl_s: float, chunk: int = 0
              ) -> Callable[[int], bool]:
    """A prompt is long when decode's step carrying it (a chunk of it, where the engines
    cap a request's prompt tokens per step) would break the ITL objective."""
    def is_long(tokens: int) -> bool:
        step_tokens = min(tokens, chunk) if chunk else tokens
        return cost.base_s + cost.per_seq_s * batch + cost.per_token_s * step_tokens > itl_s
    return is_long


def _fmt_split(split: Split) -> str:
    return f"{split.num_prefill}P{split.num_decode}D"


def _fmt_demand(inputs: PlannerInputs) -> str:
    d = inputs.demand
    return (f"long {d.long_tokens_per_s:.0f} + short {d.short_tokens_per_s:.0f} prompt tok/s, "
            f"{d.output_tokens_per_s:.0f} out tok/s, itl {inputs.itl_s * 1e3:.0f} ms")


def _fmt(load: SplitLoad | None) -> str:
    return "-" if load is None else f"prefill {load.prefill:.2f} / decode {load.decode:.2f}"
