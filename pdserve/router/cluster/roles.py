"""Runtime role switching, the router's side (``POST /admin/workers/{id}/role``, the planner).

A worker's role is state, not a process type: ``SetRole`` makes a worker drain the
old role's work (its in-flight decodes finish, or past the drain timeout are aborted
and continue on another decode worker through migration; a prefill's leased KV is
loaded or released), switch its engine's role without reloading weights or dropping
the prefix cache, and re-announce itself (etcd: its key moves to the new role).

``RoleSwitcher`` is what the admin route and the planner call. While the switch
runs, this router places nothing on the worker (``Worker.begin_switch``; other
routers see it not ready in its Health); once it ends, the pool files the worker
under its new role. Refused before any call: an unknown worker (``NotFound``), a worker
already switching (``Conflict``), and the switch of the last healthy decode worker of its
model to prefill (``Conflict``: nothing could serve; ``force`` overrides). A bad role is
the body's to refuse (``http/admin/bodies.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.core.types import Role, RoleSwitch
from pdserve.router.cluster.errors import ClusterError, Conflict, Failed, NotFound, Unavailable
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool
from pdserve.router.metrics import PREFIX, counter

logger = logging.getLogger("pdserve.router.roles")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
# The worker's own bound on ending its work past the drain (lifecycle._END_WORK_GRACE_S)
# plus the re-announcement: the SetRole call's deadline is the drain timeout plus this.
CALL_SLACK_S = 20.0
OUTCOMES = ("switched", "unchanged", "refused", "failed")


@dataclass(frozen=True)
class RoleSwitchOutcome:
    worker_id: str
    previous_role: str
    result: RoleSwitch
    seconds: float

    def body(self) -> dict[str, object]:
        r = self.result
        return {"id": self.worker_id, "role": r.role, "previous_role": self.previous_role,
                "changed": r.changed, "num_aborted": r.num_aborted,
                "num_leases_released": r.num_leases_released,
                "switch_seconds": r.switch_ns / 1e9, "seconds": self.seconds}


class RoleSwitcher:
    def __init__(self, pool: WorkerPool, registry: CollectorRegistry | None = None,
                 call_slack_s: float = CALL_SLACK_S) -> None:
        self._pool = pool
        self._call_slack_s = call_slack_s
        self._switches = counter(
            registry, f"{PREFIX}role_switches", "Worker role switches this router asked "
            "for, by the role asked for and outcome (switched, unchanged, refused: before "
            "any call; failed: the worker kept its role)", ["role", "outcome"])
        for role in ("prefill", "decode"):
            for outcome in OUTCOMES:
                self._switches.labels(role, outcome)

    async def switch(self, worker_id: str, role: Role,
                     drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
                     force: bool = False) -> RoleSwitchOutcome:
        """Switch ``worker_id`` to ``role``; raises a ``ClusterError`` when refused or
        failed."""
        worker = self._pool.find(worker_id)
        if worker is None:
            self._switches.labels(role, "refused").inc()
            raise NotFound(f"no worker {worker_id!r} in this router's view",
                           param="id", code="worker_not_found")
        try:
            self._check(worker, role, force)
        except ClusterError:
            self._switches.labels(role, "refused").inc()
            raise
        previous = worker.role
        started = time.monotonic()
        if previous == role:
            self._switches.labels(role, "unchanged").inc()
            return RoleSwitchOutcome(worker.snapshot().worker_id, previous,
                                     RoleSwitch(role=role, changed=False), 0.0)
        worker.begin_switch()
        ended_in: str | None = None  # the role it serves after the call (None: unknown)
        try:
            result = await worker.client.set_role(role, drain_timeout_s,
                                                  drain_timeout_s + self._call_slack_s)
            ended_in = result.role
        except WorkerCallError as exc:
            self._switches.labels(role, "failed").inc()
            logger.warning("role switch of %s to %s failed: %s %s", worker_id, role, exc.code,
                           exc.details)
            raise _switch_error(exc) from None
        finally:  # cancelled too: never leave the worker out of placement
            worker.end_switch(ended_in)
        # Placeable in its new role now, not at the next probe. etcd membership may
        # have replaced the member already (its key moved): refresh whoever it is now.
        await (self._pool.find(worker_id) or worker).refresh(2.0)
        self._switches.labels(role, "switched" if result.changed else "unchanged").inc()
        outcome = RoleSwitchOutcome(worker.snapshot().worker_id, previous, result,
                                    time.monotonic() - started)
        logger.info("worker %s switched %s -> %s in %.2f s (%d aborted, %d leases released)",
                    outcome.worker_id, previous, result.role, outcome.seconds,
                    result.num_aborted, result.num_leases_released)
        return outcome

    def _check(self, worker: Worker, role: Role, force: bool) -> None:
        if worker.switching:
            raise Conflict(f"worker {worker.snapshot().worker_id} is already switching "
                           "role", code="role_switch_running")
        if role == "prefill" and worker.role == "decode" and not force:
            model = worker.snapshot().model
            others = [w for w in self._pool.decode if w is not worker
                      and w.snapshot().healthy and w.snapshot().model == model]
            if not others:
                raise Conflict(
                    f"worker {worker.snapshot().worker_id} is the last healthy decode worker "
                    f"of {model or 'its model'}: nothing would serve it (force: true "
                    "overrides)", code="last_decode_worker")


def _switch_error(exc: WorkerCallError) -> ClusterError:
    what = f"the worker refused the role switch: {exc.details}"
    if exc.code in ("FAILED_PRECONDITION", "UNIMPLEMENTED"):
        return Conflict(what, code="role_switch_refused")
    if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        return Unavailable(f"role switch failed ({exc.code}): {exc.details}",
                           code="role_switch_failed")
    return Failed(f"role switch failed ({exc.code}): {exc.details}",
                  code="role_switch_failed")
