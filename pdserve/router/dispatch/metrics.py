"""The dispatcher's metrics: fallbacks, worker errors, KV handoffs, disaggregation
decisions, deadlines, ejections, and placement decisions per worker (whose label sets
leave with their worker)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from pdserve.core.types import PHASES
from pdserve.kv_transfer.base import transport_names
from pdserve.router.dispatch.policies.disagg import DECISION_REASONS, DisaggDecision
from pdserve.router.dispatch.workers.state import WorkerState
from pdserve.router.metrics import PREFIX, NullMetric, counter, gauge

# pdserve:kv_handoffs_total{transport,mode}: layer by layer into decode's inbox, or pulled.
HANDOFF_MODES = ("push", "pull")
# pdserve:slo_estimate_seconds{what}: the last SLO decision's inputs.
SLO_ESTIMATES = ("local_ttft", "local_step", "remote_ttft", "ttft_objective", "itl_objective")


class DispatchMetrics:
    def __init__(self, registry: CollectorRegistry | None, policy: str) -> None:
        r = registry
        self.fallbacks = counter(
            r, f"{PREFIX}prefill_fallbacks", "Requests sent to prefill whose prefill call "
            "failed, so decode computed the prompt itself (failures only; a local decision "
            "is counted in pdserve:disagg_decisions_total).")
        self.weight_reruns = counter(
            r, f"{PREFIX}weight_update_reruns", "Requests a weight update (policy abort) "
            "ended before any output and that ran again, from the prompt, on the new weights.")
        self.worker_errors = counter(r, f"{PREFIX}worker_errors", "Failed worker calls, by "
                                     "role and status.", ["role", "code"])
        self.handoffs = counter(r, f"{PREFIX}kv_handoffs", "Requests whose KV went from "
                                "prefill to decode, by the handle's transport and mode (push: "
                                "layer by layer into decode's inbox; pull).",
                                ["transport", "mode"])
        self.disagg_decisions = counter(
            r, f"{PREFIX}disagg_decisions", "Per-request disaggregation decisions: remote "
            "(prefill, then decode loads the KV) or local (decode computes the prompt), by "
            "the rule that decided.", ["decision", "reason"])
        self.deadlines_exceeded = counter(
            r, f"{PREFIX}deadline_exceeded", "Requests whose deadline passed before they "
            "finished (answered 504), by the phase it passed in.", ["phase"])
        self.ejections = counter(r, f"{PREFIX}worker_ejections", "Workers ejected from "
                                 "placement by their circuit breaker (repeated failed calls), "
                                 "by role.", ["role"])
        self.slo_estimates = gauge(
            r, f"{PREFIX}slo_estimate_seconds", "The last SLO-driven disaggregation "
            "decision's estimates: decode's TTFT and step with the prompt prefilled there "
            "(local), the prefill worker's queue + compute (remote), and the objectives.",
            ["what"])
        self.placements = PlacementCounts(registry, policy)
        for role in PHASES:  # bounded label sets exist from the start (0, not absent)
            self.deadlines_exceeded.labels(role)
            self.ejections.labels(role)
        for decision, reason in DECISION_REASONS:
            self.disagg_decisions.labels(decision, reason)
        for what in SLO_ESTIMATES:
            self.slo_estimates.labels(what)
        for transport in transport_names():
            for mode in HANDOFF_MODES:
                self.handoffs.labels(transport, mode)

    def on_decision(self, disagg: DisaggDecision) -> None:
        self.disagg_decisions.labels(disagg.decision, disagg.reason).inc()
        est = disagg.estimate
        if est is not None:
            for what, value in zip(SLO_ESTIMATES, (est.local_ttft_s, est.local_step_s,
                                                   est.remote_ttft_s, est.ttft_slo_s,
                                                   est.itl_slo_s), strict=True):
                self.slo_estimates.labels(what).set(value)


class PlacementCounts:
    """``pdserve:placement_decisions_total{policy,role,worker_id}``. Each member's child
    is looked up once; its label set is removed when the member leaves the view
    (``forget``) or reports another id (``on_renamed``: a static member restarted), so
    worker ids churning across restarts do not pile up."""

    def __init__(self, registry: CollectorRegistry | None, policy: str) -> None:
        self._family = counter(registry, f"{PREFIX}placement_decisions", "Requests placed, "
                               "by placement policy, role and worker id.",
                               ["policy", "role", "worker_id"])
        self._policy = policy
        # member id -> (its worker_id label, the child)
        self._children: dict[str, tuple[str, Counter | NullMetric]] = {}

    def on_placed(self, worker: WorkerState) -> None:
        self._child(worker).inc()

    def on_joined(self, worker: WorkerState) -> None:
        """A member's series exists (at 0) before its first placement, under the id
        placement counts it by: from when it joins the view, or, for a static member
        (whose id is its endpoint until then), from its first Health (``on_renamed``).
        A fresh cluster's dashboard shows every worker, and no series vanishes."""
        if worker.id_known:
            self._child(worker)

    def on_renamed(self, worker: WorkerState) -> None:
        """Its Health names another id (first answer, or a restart): its series is the
        new id's, at 0; the old id's label set goes."""
        self._child(worker)

    def _child(self, worker: WorkerState) -> Counter | NullMetric:
        entry = self._children.get(worker.member_id)
        if entry is None or entry[0] != worker.worker_id:
            self.forget(worker)
            entry = self._children[worker.member_id] = (worker.worker_id, self._family.labels(
                self._policy, worker.role, worker.worker_id))
        return entry[1]

    def forget(self, worker: WorkerState) -> None:
        entry = self._children.pop(worker.member_id, None)
        if entry is not None:
            self._family.remove(self._policy, worker.role, entry[0])
