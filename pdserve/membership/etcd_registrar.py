"""etcd membership, worker side: the worker's info under a lease.

The lease has ``ttl_s`` (10 s by default) and is kept alive every ``ttl_s / 3``.
When a keepalive finds the lease gone (the process was paused past its TTL, or
etcd lost it), the info is written again under a new lease. While etcd is
unreachable the loop keeps trying at the same pace, logging once per outage.
``close()`` revokes the lease, so the router drops the worker at once instead of
after the TTL. With the cluster secret the entry carries its MAC (``signed.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import TypeVar

from pdserve.core.bounded import bounded
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.tasks import cancel_and_wait
from pdserve.membership.base import WorkerInfo, worker_key
from pdserve.membership.etcd import (
    DEFAULT_CALL_TIMEOUT_S,
    ETCD_ERRORS,
    close_client,
    etcd_client,
    outage,
    refresh_lease_once,
    renew_if_unauthenticated,
)
from pdserve.membership.etcd_client import EtcdAuth
from pdserve.membership.signed import signed_value

logger = logging.getLogger("pdserve.membership.registrar")

T = TypeVar("T")

DEFAULT_TTL_S = 10


class EtcdRegistrar:
    def __init__(self, url: str, cluster: str = "default", ttl_s: int = DEFAULT_TTL_S,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 tls: TlsFiles | None = None, secret: ClusterSecret | None = None,
                 auth: EtcdAuth | None = None) -> None:
        if ttl_s < 2:
            raise ValueError("--etcd-ttl-s must be >= 2 (etcd's minimum lease TTL)")
        self._client = etcd_client(url, call_timeout_s, tls, auth)
        self._secret = secret
        self._url = url
        self._cluster = cluster
        self.ttl_s = ttl_s
        self._call_timeout_s = call_timeout_s
        self._info: WorkerInfo | None = None
        self._key = ""
        self.lease_id: int | None = None
        self.num_registrations = 0
        self._outage_logged = False
        self._task: asyncio.Task[None] | None = None
        # One change of the registration at a time (the keepalive loop, a role switch's
        # update, close); none after close.
        self._lock = asyncio.Lock()
        self._closed = False

    async def start(self, info: WorkerInfo) -> None:
        self._info = info
        self._key = worker_key(self._cluster, info.role, info.worker_id)
        async with self._lock:
            await self._tick()
        self._task = asyncio.create_task(self._keepalive_loop(), name="pdserve-registrar")

    async def update(self, info: WorkerInfo) -> None:
        """The old key goes with its lease (revoked: the routers drop it at once), the
        new one is written under a new lease; during an outage the old lease expires
        and the keepalive loop writes the new key once etcd answers."""
        async with self._lock:
            if self._closed:
                return
            old_lease, self.lease_id = self.lease_id, None
            self._info = info
            self._key = worker_key(self._cluster, info.role, info.worker_id)
            if old_lease is not None:
                with contextlib.suppress(*ETCD_ERRORS):
                    await self._call(self._client.revoke_lease(old_lease))
            await self._tick()

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        async with self._lock:
            self._closed = True
        if self.lease_id is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._call(self._client.revoke_lease(self.lease_id))
                logger.info("revoked the lease of %s", self._key)
            self.lease_id = None
        await close_client(self._client, self._call_timeout_s)

    async def _keepalive_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            async with self._lock:
                await self._tick()

    async def _tick(self) -> None:
        """Keep the lease alive, or register anew; never raises for an etcd outage."""
        try:
            if self.lease_id is None or not await self._refresh():
                await self._register()
        except ETCD_ERRORS as exc:
            await renew_if_unauthenticated(self._client, exc, self._call_timeout_s)
            if not self._outage_logged:
                logger.warning("etcd %s %s (%s: %s); retrying every %.1fs", self._url,
                               outage(exc), type(exc).__name__, exc, self.ttl_s / 3)
            self._outage_logged = True
            return
        if self._outage_logged:
            logger.info("etcd %s reachable again; %s is registered", self._url, self._key)
        self._outage_logged = False

    async def _refresh(self) -> bool:
        """True while the lease lives; False once etcd says it expired."""
        assert self.lease_id is not None
        reply = await self._call(refresh_lease_once(self._client, self.lease_id))
        if reply is not None and reply.TTL > 0:
            return True
        logger.warning("lease of %s expired; registering again with a new lease", self._key)
        self.lease_id = None
        return False

    async def _register(self) -> None:
        assert self._info is not None
        lease = await self._call(self._client.lease(self.ttl_s))
        value = signed_value(self._secret, self._key, self._info)
        await self._call(self._client.put(self._key.encode(), value, lease=lease))
        self.lease_id = lease.id
        self.num_registrations += 1
        logger.info("registered %s at %s (lease %x, TTL %ds)", self._key, self._url, lease.id,
                    self.ttl_s)

    async def _call(self, coro: Awaitable[T]) -> T:
        """Every etcd call has a deadline (aetcd's own, and this one as a backstop)."""
        return await bounded(coro, self._call_timeout_s + 1)
