"""The router's view of its workers: one gRPC channel per worker, kept healthy
by a background loop (Health + GetLoad with deadlines).

The set is dynamic: the pool is the ``MembershipSink`` of a ``Membership`` (static
flags, or etcd) and adds/removes workers as it reports them. A new worker gets a
health check at once and is placed only once that passes; a removed worker's
channel is closed once its requests end (bounded). ``on_worker_added`` /
``on_worker_removed`` let other router state (e.g. a prefix index) follow.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc

from pdserve.membership import Membership, WorkerInfo
from pdserve.membership.static import static_infos

logger = logging.getLogger("pdserve.router.workers")

_CLOSE_GRACE_S = 10.0
_ROLE_NAMES = {pb.ROLE_PREFILL: "prefill", pb.ROLE_DECODE: "decode"}


@dataclass
class WorkerLoad:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_inflight_reqs: int = 0


@dataclass
class WorkerState:
    """What placement may read about a worker (a snapshot; never mutated by policies)."""

    endpoint: str
    role: str
    healthy: bool = False
    worker_id: str = ""
    compatibility_hash: str = ""
    max_model_len: int = 0
    # KV endpoint, and whether the worker sends/accepts layer-wise push.
    kv_host: str = ""
    kv_port: int = 0
    kv_push: bool = False
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Requests this router has sent and not seen finish (fresher than GetLoad).
    num_assigned: int = 0
    # Prompt tokens not in the worker's prefix cache, summed over the prefills
    # this router has sent it and not seen finish (queued prefill work).
    num_assigned_tokens: int = 0


class WorkerClient:
    def __init__(self, info: WorkerInfo) -> None:
        self.info = info
        # Registered members must answer with the id they registered (a stale record
        # may point at a port another worker now uses). Static members, whose id is
        # their endpoint until Health tells, learn it.
        static = info.worker_id == info.grpc_endpoint
        self._expected_id = None if static else info.worker_id
        self.state = WorkerState(endpoint=info.grpc_endpoint, role=info.role,
                                 worker_id=info.worker_id,
                                 compatibility_hash=info.compatibility_hash,
                                 max_model_len=info.max_model_len)
        self.channel = grpc.aio.insecure_channel(
            info.grpc_endpoint, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.WorkerServiceStub(self.channel)

    @property
    def member_id(self) -> str:
        return self.info.member_id

    async def refresh(self, timeout_s: float) -> None:
        """Health, then load; any failure marks the worker unhealthy."""
        try:
            health = await self.stub.Health(pb.HealthRequest(), timeout=timeout_s)
            role = _ROLE_NAMES.get(health.role, "")
            if role != self.state.role:
                raise RuntimeError(f"{self.state.endpoint} is a {role or 'unknown'} worker")
            if self._expected_id is not None and health.worker_id != self._expected_id:
                raise RuntimeError(f"{self.state.endpoint} is worker {health.worker_id!r}, "
                                   f"not the registered {self._expected_id!r}")
            load = await self.stub.GetLoad(pb.GetLoadRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, RuntimeError) as exc:
            self.mark_unhealthy(str(exc.details() if isinstance(exc, grpc.aio.AioRpcError)
                                    else exc))
            return
        if not self.state.healthy and health.ready:
            logger.info("%s worker %s at %s is healthy", self.state.role, health.worker_id,
                        self.state.endpoint)
        self.state.healthy = health.ready
        self.state.worker_id = health.worker_id
        self.state.compatibility_hash = health.compatibility_hash
        self.state.max_model_len = health.max_model_len
        self.state.kv_host, self.state.kv_port = health.kv_host, health.kv_port
        self.state.kv_push = health.kv_push
        self.state.load = WorkerLoad(load.num_running_reqs, load.num_waiting_reqs,
                                     load.kv_cache_usage, load.num_inflight_reqs)

    def mark_unhealthy(self, why: str) -> None:
        if self.state.healthy:
            logger.warning("%s worker at %s unhealthy: %s", self.state.role,
                           self.state.endpoint, why)
        self.state.healthy = False

    async def close(self, grace_s: float | None = None) -> None:
        await self.channel.close(grace_s)


Listener = Callable[[WorkerState], None]


class WorkerPool:
    """The current workers, by role. Static endpoints given here are members from
    the start; a ``Membership`` passed to ``start`` then owns the set."""

    def __init__(self, prefill: Sequence[str] = (), decode: Sequence[str] = (),
                 interval_s: float = 2.0) -> None:
        self._interval_s = interval_s
        self._members: dict[str, WorkerClient] = {}
        self.prefill: list[WorkerClient] = []
        self.decode: list[WorkerClient] = []
        self._added: list[Listener] = []
        self._removed: list[Listener] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._task: asyncio.Task[None] | None = None
        self._membership_task: asyncio.Task[None] | None = None
        for info in static_infos(prefill, decode):
            self._add(WorkerClient(info))

    @property
    def all(self) -> list[WorkerClient]:
        return self.prefill + self.decode

    def on_worker_added(self, listener: Listener) -> None:
        """Call ``listener(state)`` when a worker joins (before its first health check)."""
        self._added.append(listener)

    def on_worker_removed(self, listener: Listener) -> None:
        """Call ``listener(state)`` when a worker leaves the view."""
        self._removed.append(listener)

    def describe(self) -> list[dict[str, object]]:
        """The current view, for ``GET /workers``."""
        return [
            {"id": w.state.worker_id, "role": w.state.role, "endpoint": w.state.endpoint,
             "healthy": w.state.healthy, "compatibility_hash": w.state.compatibility_hash,
             "load": asdict(w.state.load), "num_assigned": w.state.num_assigned}
            for w in self.all
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
        client = WorkerClient(info)
        self._add(client)
        self._spawn(client.refresh(max(self._interval_s, 1.0)))  # routable once this passes

    async def delete(self, member_id: str) -> None:
        if member_id in self._members:
            self._remove(member_id)

    def _add(self, client: WorkerClient) -> None:
        self._members[client.member_id] = client
        self._rebuild()
        logger.info("%s worker %s at %s joined the view", client.state.role,
                    client.info.worker_id, client.state.endpoint)
        self._notify(self._added, client.state)

    def _remove(self, member_id: str) -> None:
        client = self._members.pop(member_id)
        self._rebuild()
        client.state.healthy = False
        logger.info("%s worker %s at %s left the view", client.state.role,
                    client.info.worker_id, client.state.endpoint)
        self._notify(self._removed, client.state)
        self._spawn(client.close(_CLOSE_GRACE_S))  # its requests end or are cancelled

    def _rebuild(self) -> None:
        members = sorted(self._members.values(), key=lambda w: w.member_id)
        self.prefill = [w for w in members if w.state.role == "prefill"]
        self.decode = [w for w in members if w.state.role == "decode"]

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
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.all))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh_all()


def _log_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.error("membership stopped: %r; the worker set is frozen", task.exception(),
                     exc_info=task.exception())
