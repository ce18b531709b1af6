"""The router's view of its workers: one ``WorkerClient`` (gRPC channel) per
worker, kept healthy by a background loop (Health + GetLoad with deadlines).
Placement reads each worker's immutable ``WorkerState`` snapshot.

The set is dynamic: the pool is the ``MembershipSink`` of a ``Membership`` (static
flags, or etcd) and adds/removes workers as it reports them. A new worker gets a
health check at once and is placed only once that passes; a removed worker's
channel is closed once its requests end (bounded). ``on_worker_added`` /
``on_worker_removed`` / ``on_worker_renamed`` let other router state (e.g. a prefix
index, per-worker metrics) follow.

A worker is placeable when its last health check passed (a draining worker answers
not ready: it gets nothing new, and its streams go on) and its circuit breaker
(``breaker.py``) is closed: the dispatcher reports each call's outcome
(``on_call_failed`` / ``on_call_succeeded``).
"""


from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, replace
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.tasks import cancel_and_wait
from pdserve.membership import Membership, WorkerInfo
from pdserve.membership.static import static_infos
from pdserve.router.dispatch.workers.breaker import DEFAULT_BREAKER, BreakerConfig
from pdserve.router.dispatch.workers.loras import LoraTargets
from pdserve.router.dispatch.workers.state import WorkerState
from pdserve.router.dispatch.workers.worker import MAX_SLOW_PROBES, Worker, step_cost

__all__ = ["MAX_SLOW_PROBES", "Listener", "Worker", "WorkerPool", "step_cost"]

logger = logging.getLogger("pdserve.router.workers")

# A removed worker's requests may run this long before its channel cancels them (a
# draining worker leaves membership first, then finishes them).
_CLOSE_GRACE_S = 600.0


Listener = Callable[[WorkerState], None]


class WorkerPool:
    """The current workers, by role. Static endpoints given here are members from
    the start; a ``Membership`` passed to ``start`` then owns the set."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (),
                 interval_s: float = 2.0, secret: ClusterSecret | None = None,
                 tls: GrpcTls | None = None, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 breaker: BreakerConfig = DEFAULT_BREAKER,
                 close_grace_s: float = _CLOSE_GRACE_S) -> None:
        self._interval_s = interval_s
        # The cluster's secret (every worker's client carries its token) and gRPC TLS.
        self._secret, self._tls = secret, tls
        self._keepalive_s = keepalive_s
        self._breaker = breaker
        self._close_grace_s = close_grace_s
        self._closing: set[Worker] = set()  # removed, channel closing once its calls end
        self.weight_target = ""  # see ``set_weight_target``
        self.lora_targets = LoraTargets()  # the adapters every worker is brought to
        self._members: dict[str, Worker] = {}
        self.prefill: list[Worker] = []
        self.decode: list[Worker] = []
        self._added: list[Listener] = []
        self._removed: list[Listener] = []
        self._renamed: list[Listener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._membership_task: asyncio.Task[None] | None = None
        for info in static_infos(prefill, decode):
            self._add(self._worker(info))

    @property
    def all(self) -> list[Worker]:
        return self.prefill + self.decode

    def on_worker_added(self, listener: Listener) -> None:
        """Call ``listener(snapshot)`` when a worker joins (before its first health check)."""
        self._added.append(listener)

    def on_worker_removed(self, listener: Listener) -> None:
        """Call ``listener(snapshot)`` when a worker leaves the view."""
        self._removed.append(listener)

    def on_worker_renamed(self, listener: Listener) -> None:
        """Call ``listener(snapshot)`` when a member's Health names another id than its
        snapshot did: a static member's first answer (its id was its endpoint until
        then), or a static member restarted under a new id."""
        self._renamed.append(listener)

    def describe(self) -> list[dict[str, object]]:
        """The current view, for ``GET /workers``."""
        return [
            {"id": s.worker_id, "role": s.role, "endpoint": s.endpoint,
             "healthy": s.healthy, "ejected": w.ejected, "switching": w.switching,
             "compatibility_hash": s.compatibility_hash, "weight_version": s.weight_version,
             "load": asdict(s.load), "num_assigned": s.num_assigned,
             "metrics_endpoint": w.metrics_endpoint}
            for w, s in ((w, w.snapshot()) for w in self.all)
        ]

    # MembershipSink
    async def replace_all(self, infos: Sequence[WorkerInfo]) -> None:
        wanted = {info.member_id: info for info in infos}
        for member_id in [m for m in self._members if m not in wanted]:
            self._remove(member_id)
        for info in wanted.values():
            await self.put(info)

    async def put(self, info: WorkerInfo) -> None:
        current = self._members.get(info.member_id)
        if current is not None and current.info == info:
            return
        if current is not None:
            self._remove(info.member_id)
        worker = self._worker(info)
        self._add(worker)
        self._spawn(worker.refresh(max(self._interval_s, 1.0)))  # routable once this passes

    async def delete(self, member_id: str) -> None:
        if member_id in self._members:
            self._remove(member_id)

    def _worker(self, info: WorkerInfo) -> Worker:
        worker = Worker(info, self._secret, self._tls, self._keepalive_s, self._breaker,
                        self._role_changed, self._id_changed, self.lora_targets)
        worker.weight_target = self.weight_target
        return worker

    def set_weight_target(self, version: str) -> None:
        """Place only on workers serving ``version`` ("": any), those joining later too."""
        self.weight_target = version
        for worker in self.all:
            worker.set_weight_target(version)

    def _role_changed(self, worker: Worker, old_role: str) -> None:
        """A member switched role: filed under the new one; listeners see it leave the
        old role and join the new (the prefix index follows prefill workers only)."""
        if self._members.get(worker.member_id) is not worker:
            return  # already replaced (etcd moved its key before the switch returned)
        self._rebuild()
        self._notify(self._removed, replace(worker.snapshot(), role=old_role))
        self._notify(self._added, worker.snapshot())

    def _id_changed(self, worker: Worker) -> None:
        if self._members.get(worker.member_id) is worker:  # not a replaced one's late probe
            self._notify(self._renamed, worker.snapshot())

    def find(self, worker_id: str) -> Worker | None:
        """A member by the id it reports, its registered id, or its member id."""
        for worker in self.all:
            if worker_id in (worker.snapshot().worker_id, worker.info.worker_id,
                             worker.member_id):
                return worker
        return None

    def _add(self, worker: Worker) -> None:
        self._members[worker.member_id] = worker
        self._rebuild()
        logger.info("%s worker %s at %s joined the view", worker.info.role,
                    worker.info.worker_id, worker.info.grpc_endpoint)
        self._notify(self._added, worker.snapshot())

    def _remove(self, member_id: str) -> None:
        worker = self._members.pop(member_id)
        self._rebuild()
        worker.on_removed()
        logger.info("%s worker %s at %s left the view", worker.info.role,
                    worker.info.worker_id, worker.info.grpc_endpoint)
        self._notify(self._removed, worker.snapshot())
        self._closing.add(worker)
        self._spawn(self._close_removed(worker))

    async def _close_removed(self, worker: Worker) -> None:
        """Its requests end (a draining worker finishes them) or are cancelled."""
        await worker.close(self._close_grace_s)
        self._closing.discard(worker)

    def _rebuild(self) -> None:
        members = sorted(self._members.values(), key=lambda w: w.member_id)
        self.prefill = [w for w in members if w.role == "prefill"]
        self.decode = [w for w in members if w.role == "decode"]

    @staticmethod
    def _notify(listeners: list[Listener], state: WorkerState) -> None:
        for listener in listeners:
            try:
                listener(state)
            except Exception:  # noqa: BLE001 - a listener must not break membership
                logger.exception("worker listener %r failed", listener)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        try:
            task = asyncio.get_running_loop().create_task(coro)
        except RuntimeError:  # no loop yet (static members): start() checks them
            coro.close()
            return
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def refresh_all(self) -> None:
        timeout = max(self._interval_s, 1.0)
        await asyncio.gather(*(w.refresh(timeout) for w in self.all))

    async def start(self, membership: Membership | None = None) -> None:
        await self.refresh_all()
        if membership is not None:
            self._membership_task = asyncio.create_task(membership.run(self),
                                                        name="pdserve-membership")
            self._membership_task.add_done_callback(_log_if_failed)
        self._task = asyncio.create_task(self._loop(), name="pdserve-health")

    async def close(self) -> None:
        for task in (self._membership_task, self._task):
            await cancel_and_wait(task)
        for task in self._tasks:  # a removed worker's patient close among them
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in [*self.all, *self._closing]))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh_all()


def _log_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("membership stopped: %r; the worker set is frozen", task.exception(),
                     exc_info=task.exception())
