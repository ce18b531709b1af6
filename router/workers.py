"""The router's view of its workers: one gRPC channel per worker, kept healthy
by a background loop (Health + GetLoad with deadlines)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict, dataclass, field

import grpc
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc

logger = logging.getLogger("pdserve.router.workers")

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
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Requests this router has sent and not seen finish (fresher than GetLoad).
    num_assigned: int = 0
    # Prompt tokens not in the worker's prefix cache, summed over the prefills
    # this router has sent it and not seen finish (queued prefill work).
    num_assigned_tokens: int = 0


class WorkerClient:
    def __init__(self, endpoint: str, role: str) -> None:
        self.state = WorkerState(endpoint=endpoint, role=role)
        self.channel = grpc.aio.insecure_channel(
            endpoint, options=[("grpc.max_receive_message_length", 64 << 20)]
        )
        self.stub = pb_grpc.WorkerServiceStub(self.channel)

    async def refresh(self, timeout_s: float) -> None:
        """Health, then load; any failure marks the worker unhealthy."""
        try:
            health = await self.stub.Health(pb.HealthRequest(), timeout=timeout_s)
            role = _ROLE_NAMES.get(health.role, "")
            if role != self.state.role:
                raise RuntimeError(f"{self.state.endpoint} is a {role or 'unknown'} worker")
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
        self.state.load = WorkerLoad(load.num_running_reqs, load.num_waiting_reqs,
                                     load.kv_cache_usage, load.num_inflight_reqs)

    def mark_unhealthy(self, why: str) -> None:
        if self.state.healthy:
            logger.warning("%s worker at %s unhealthy: %s", self.state.role,
                           self.state.endpoint, why)
        self.state.healthy = False

    async def close(self) -> None:
        await self.channel.close()


class WorkerPool:
    """Static membership: the workers named on the command line."""

    def __init__(self, prefill: list[str], decode: list[str], interval_s: float = 2.0) -> None:
        self.prefill = [WorkerClient(e, "prefill") for e in prefill]
        self.decode = [WorkerClient(e, "decode") for e in decode]
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    @property
    def all(self) -> list[WorkerClient]:
        return self.prefill + self.decode

    def describe(self) -> list[dict[str, object]]:
        """The current view, for ``GET /workers``."""
        return [
            {"id": w.state.worker_id, "role": w.state.role, "endpoint": w.state.endpoint,
             "healthy": w.state.healthy, "compatibility_hash": w.state.compatibility_hash,
             "load": asdict(w.state.load), "num_assigned": w.state.num_assigned}
            for w in self.all
        ]

    async def refresh_all(self) -> None:
        timeout = max(self._interval_s, 1.0)
        await asyncio.gather(*(w.refresh(timeout) for w in self.all))

    async def start(self) -> None:
        await self.refresh_all()
        self._task = asyncio.create_task(self._loop(), name="pdserve-health")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await asyncio.gather(*(w.close() for w in self.all))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh_all()
