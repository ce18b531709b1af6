"""The router's view of its workers as metrics, read from the pool at scrape time (no
work on the request path, and a worker that left the view leaves the output with it):

  pdserve:workers{role,state}                      members by state: healthy, unhealthy
                                                   (not ready, unreachable), ejected
                                                   (circuit breaker open)
  pdserve:worker_assigned_requests{role,worker}    requests this router sent and has not
                                                   seen finish, per current member
  pdserve:membership_changes_total{role,change}    members joined / left the view
  pdserve:worker_step_seconds{role,worker,term}    the engine's measured step time fit
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import WorkerState
from pdserve.router.metrics import PREFIX

WORKER_STATES = ("healthy", "unhealthy", "ejected")
ROLES = ("prefill", "decode")


class PoolCollector(Collector):
    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        counts = {(role, state): 0 for role in ROLES for state in WORKER_STATES}
        assigned = GaugeMetricFamily(
            f"{PREFIX}worker_assigned_requests", "Requests this router sent to the worker "
            "and has not seen finish, per member of the current view (role/worker id).",
            labels=["role", "worker"])
        for worker in self._pool.all:
            state = worker.snapshot()
            key = (state.role, "ejected" if worker.ejected
                   else "healthy" if state.healthy else "unhealthy")
            counts[key] = counts.get(key, 0) + 1
            assigned.add_metric([state.role, _worker_label(state)], state.num_assigned)
        workers = GaugeMetricFamily(f"{PREFIX}workers", "Workers in the router's view, by "
                                    "role and state (healthy, unhealthy, ejected).",
                                    labels=["role", "state"])
        for (role, state_name), n in counts.items():
            workers.add_metric([role, state_name], n)
        yield workers
        yield assigned
        yield self._steps()

    def _steps(self) -> GaugeMetricFamily:
        steps = GaugeMetricFamily(
            f"{PREFIX}worker_step_seconds", "Each worker engine's measured step time: "
            "base + per_seq x sequences decoding + per_token x prompt tokens computed "
            "(what the SLO-driven decisions read); absent until it has measured a step.",
            labels=["role", "worker", "term"])
        for worker in self._pool.all:
            state = worker.snapshot()
            cost = state.load.step
            if cost is not None:
                for term, value in (("base", cost.base_s), ("per_seq", cost.per_seq_s),
                                    ("per_token", cost.per_token_s)):
                    steps.add_metric([state.role, _worker_label(state), term], value)
        return steps


def _worker_label(state: WorkerState) -> str:
    """``role/worker id``, the id as the worker's Health names it (the one placement
    counts it by): a static member's endpoint stands in only until its first answer."""
    return f"{state.role}/{state.worker_id}"


def register_pool_metrics(pool: WorkerPool, registry: CollectorRegistry) -> None:
    """The collector above, and the joined/left counters fed by the pool's hooks."""
    registry.register(PoolCollector(pool))
    changes = Counter(f"{PREFIX}membership_changes", "Workers that joined or left the "
                      "router's view, by role.", ["role", "change"], registry=registry)
    for role in ROLES:  # at 0 from start-up
        for change in ("joined", "left"):
            changes.labels(role, change)

    def joined(state: WorkerState) -> None:
        changes.labels(state.role, "joined").inc()

    def left(state: WorkerState) -> None:
        changes.labels(state.role, "left").inc()

    for worker in pool.all:  # static members joined before the registry existed
        joined(worker.snapshot())
    pool.on_worker_added(joined)
    pool.on_worker_removed(left)
