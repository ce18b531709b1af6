"""A worker's serving state: whether it takes new requests, what the standard gRPC
health service (``grpc.health.v1``) says about it, and its drain.

States: NOT_SERVING while the engine loads; SERVING once it is ready; draining after
SIGTERM. A draining worker answers NOT_SERVING (standard health, for probes and
orchestrators) and not ready (``WorkerService.Health``, which the router's health loop
reads, so it places nothing new there), refuses a new ``Generate`` with UNAVAILABLE
(the router places it elsewhere), and finishes what it has: the calls in flight, and a
prefill's KV that a decode has still to load. Its channels stay open meanwhile.

A role switch (``switch_role``) is a drain that ends in the other role instead of an
exit: new requests are refused and health says not ready while the old role's work
ends (past the drain timeout it is ended: requests aborted, leases released), then
the backend switches, the worker re-announces itself (``on_role_changed``: its
membership registration), and serves again. A weight commit (``commit_weights``) is the
same drain ending in the staged weights (its policy ``abort`` ends the work at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import OVERALL_HEALTH
from grpc_health.v1.health import aio as health_aio

from pdserve.core.types import Role, RoleSwitch, WeightsCommitted
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.worker.backend import WorkerBackend, WorkerError

logger = logging.getLogger("pdserve.worker")

WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["WorkerService"].full_name
_SERVICES = (OVERALL_HEALTH, WORKER_SERVICE)
_DRAIN_POLL_S = 0.1
# After the drain timeout's aborts and releases: how long their ends may take to land.
_END_WORK_GRACE_S = 10.0


class Admission:
    """Counts the ``Generate`` calls in flight and refuses new ones once draining."""

    def __init__(self) -> None:
        self.draining = False
        self.switching = False  # a role switch is draining the old role
        self.num_calls = 0

    @property
    def closed(self) -> bool:
        return self.draining or self.switching

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """One ``Generate``; raises ``WorkerError("unavailable")`` while draining or
        switching role."""
        if self.draining:
            raise WorkerError("unavailable", "worker is draining")
        if self.switching:
            raise WorkerError("unavailable", "worker is switching role")
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
        self._switch = asyncio.Lock()
        # Re-announce the worker after a role switch (its membership registration).
        self.on_role_changed: Callable[[], Awaitable[None]] | None = None

    @property
    def draining(self) -> bool:
        return self.admission.draining

    @property
    def closed(self) -> bool:
        """Takes no new requests: draining, or switching role."""
        return self.admission.closed

    async def update(self) -> None:
        """Publish SERVING or NOT_SERVING: call when the engine becomes ready."""
        serving = self._backend.health().ready and not self.closed
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for service in _SERVICES:
            await self.health.set(service, status)

    async def start_drain(self) -> None:
        """Take no new requests from now on, and say so."""
        self.admission.draining = True
        await self.update()

    async def switch_role(self, role: Role, drain_timeout_s: float) -> RoleSwitch:
        """Drain the old role's work (at most ``drain_timeout_s``, then end it), switch
        the backend to ``role``, re-announce, serve again. Raises ``WorkerError``:
        unavailable while loading or draining, failed_precondition while another
        switch runs (the worker keeps its role when the switch fails)."""
        health = self._backend.health()
        if not health.ready or self.draining:
            raise WorkerError("unavailable", "worker is loading or draining")
        if self._switch.locked():
            raise WorkerError("failed_precondition", "a role switch is already running")
        if health.role == role:
            return RoleSwitch(role=role, changed=False)
        started = time.monotonic_ns()
        async with self._closed():
            aborted, released = await self._end_work(drain_timeout_s)
            self._backend.set_role(role)
            logger.info("role switched to %s in %.2f s (%d aborted, %d leases released)",
                        role, (time.monotonic_ns() - started) / 1e9, aborted, released)
        await self._reannounce()
        return RoleSwitch(role=role, changed=True, num_aborted=aborted,
                          num_leases_released=released,
                          switch_ns=time.monotonic_ns() - started)

    async def commit_weights(self, version: str, abort: bool,
                             drain_timeout_s: float) -> WeightsCommitted:
        """Let the calls in flight finish on the current weights (at most
        ``drain_timeout_s``; with ``abort``, none), then serve the staged ``version``
        and re-announce (the compatibility hash names the version). Refused like a
        role switch while loading, draining or switching."""
        if not self._backend.health().ready or self.draining:
            raise WorkerError("unavailable", "worker is loading or draining")
        if self._switch.locked():
            raise WorkerError("failed_precondition", "a role switch or weight update is running")
        started = time.monotonic_ns()
        async with self._closed():
            aborted, _ = await self._end_work(0.0 if abort else drain_timeout_s)
            await self._backend.commit_weights(version)
        await self._reannounce()
        return WeightsCommitted(weight_version=version, num_aborted=aborted,
                                commit_ns=time.monotonic_ns() - started)

    @contextlib.asynccontextmanager
    async def _closed(self) -> AsyncIterator[None]:
        """No new requests and health not ready while the body runs (one at a time)."""
        async with self._switch:
            self.admission.switching = True
            await self.update()
            try:
                yield
            finally:
                self.admission.switching = False
                await self.update()

    async def _end_work(self, drain_timeout_s: float) -> tuple[int, int]:
        """Until nothing is in flight: wait ``drain_timeout_s``, then abort what is left
        and release the KV leases; (aborted, released)."""
        idle = await self.wait_idle(drain_timeout_s)
        if self.draining:  # SIGTERM meanwhile: its drain decides, in the old state
            raise WorkerError("unavailable", "worker is draining")
        if idle:
            return 0, 0
        aborted, released = await self._backend.end_role_work()
        if not await self.wait_idle(_END_WORK_GRACE_S):
            raise WorkerError("unavailable", "the work in flight did not end")
        return aborted, released

    async def _reannounce(self) -> None:
        # A SIGTERM meanwhile: the drain withdraws the worker; do not undo it.
        if self.on_role_changed is not None and not self.draining:
            await self.on_role_changed()

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
