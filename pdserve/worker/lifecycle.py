"""A worker's serving state: whether it takes new requests, what the standard gRPC
health service (``grpc.health.v1``) says about it, and its drain.

States: NOT_SERVING while the engine loads; SERVING once it is ready; draining after
SIGTERM. A draining worker answers NOT_SERVING (standard health, for probes and
orchestrators) and not ready (``WorkerService.Health``, which the router's health loop
reads, so it places nothing new there), refuses a new ``Generate`` with UNAVAILABLE
(the router places it elsewhere), and finishes what it has: the calls in flight, and a
prefill's KV that a decode has still to load. Its channels stay open meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import OVERALL_HEALTH
from grpc_health.v1.health import aio as health_aio

from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.worker.backend import WorkerBackend, WorkerError

logger = logging.getLogger("pdserve.worker")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
_SERVICES = (OVERALL_HEALTH, WORKER_SERVICE)
_DRAIN_POLL_S = 0.1


class Admission:
    """Counts the ``Generate`` calls in flight and refuses new ones once draining."""

    def __init__(self) -> None:
        self.draining = False
        self.num_calls = 0

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One ``Generate``; raises ``WorkerError("unavailable")`` while draining."""
        if self.draining:
            raise WorkerError("unavailable", "worker is draining")
        self.num_calls += 1
        try:
            yield
        finally:
            self.num_calls -= 1


class ServingState:
    """The worker's state as its two health answers show it. ``health`` is the
    ``grpc.health.v1`` servicer registered on the worker's server."""

    def __init__(self, backend: WorkerBackend) -> None:
        self.admission = Admission()
        self.health = health_aio.HealthServicer()
        self._backend = backend

    @property
    def draining(self) -> bool:
        return self.admission.draining

    async def update(self) -> None:
        """Publish SERVING or NOT_SERVING: call when the engine becomes ready."""
        serving = self._backend.health().ready and not self.draining
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in _SERVICES:
            await self.health.set(service, status)

    async def start_drain(self) -> None:
        """Take no new requests from now on, and say so."""
        self.admission.draining = True
        await self.update()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until nothing is in flight and no KV waits for a decode to load it, or
        ``timeout_s``; whether it got there."""
        deadline = time.monotonic() + timeout_s
        while True:
            pending = 0
            if self.admission.num_calls == 0:
                pending = (await self._backend.load()).num_pending_transfers
                if pending == 0:
                    return True
            if time.monotonic() >= deadline:
                logger.warning("drain timed out with %d calls in flight, %d KV transfers "
                               "pending", self.admission.num_calls, pending)
                return False
            await asyncio.sleep(min(_DRAIN_POLL_S, max(deadline - time.monotonic(), 0.0)))
