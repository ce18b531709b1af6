"""Leader election on etcd: one key under a lease, won by a transaction.

A candidate keeps a lease of its own alive (every ``ttl_s / 3``) from ``start`` to
``close`` and campaigns with one transaction: if the key was never created
(``create_revision == 0``) put its id there under its lease; either way read the key
back. It leads while the key carries its lease. It watches the key, so a deletion (the
leader's lease revoked or expired) starts the next campaign at once; it also campaigns
on every keepalive tick, so a lost watch event costs at most one tick.

Timing: a dead leader's lease expires at most ``ttl_s`` after its last keepalive and the
survivors' watches see the key go: leadership moves within one TTL. A clean stop
revokes the lease: at once. A leader counts its lease alive from the *send* time of its
last confirmed keepalive (etcd extends it from a later instant), less a margin, so it
stops leading before etcd can expire the lease and let another candidate win.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import aetcd

from pdserve.core.bounded import bounded
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.tasks import cancel_and_wait
from pdserve.membership.election import leader_key
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
from pdserve.membership.etcd_registrar import DEFAULT_TTL_S

logger = logging.getLogger("pdserve.membership.election")
T = TypeVar("T")


class EtcdElection:
    name = "etcd"

    def __init__(self, url: str, cluster: str, candidate_id: str, ttl_s: int = DEFAULT_TTL_S,
                 *, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S, retry_s: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 tls: TlsFiles | None = None, auth: EtcdAuth | None = None) -> None:
        if ttl_s < 2:
            raise ValueError("--etcd-ttl-s must be >= 2 (etcd's minimum lease TTL)")
        self._client = etcd_client(url, call_timeout_s, tls, auth)
        self._url = url
        self.key = leader_key(cluster)
        self._key = self.key.encode()
        self.candidate_id = candidate_id
        self.ttl_s = ttl_s
        self._margin_s = min(0.5, ttl_s / 10)
        self._call_timeout_s = call_timeout_s
        self._retry_s = retry_s
        self._clock = clock
        self.lease_id: int | None = None
        self._lease_until = 0.0  # the lease is known alive until then (self._clock)
        self._holds_key = False
        self.leader_id = ""  # the key's holder as last read
        self.num_terms = 0  # how often this candidate won
        self._seen_revision = 0  # the newest change of the key the watch delivered
        self._changed = asyncio.Event()
        self._outage_logged = False
        self._task: asyncio.Task[None] | None = None

    @property
    def is_leader(self) -> bool:
        return self._holds_key and self._clock() < self._lease_until

    def describe(self) -> dict[str, object]:
        return {"kind": self.name, "candidate": True, "candidate_id": self.candidate_id,
                "leader": self.is_leader, "leader_id": self.leader_id, "ttl_s": self.ttl_s,
                "num_terms": self.num_terms}

    async def start(self) -> None:
        await self._guarded(self._tick())
        self._task = asyncio.create_task(self._run(), name="pdserve-election")

    async def close(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        self._lose("closing")
        if self.lease_id is not None:
            with contextlib.suppress(*ETCD_ERRORS):
                await self._call(self._client.revoke_lease(self.lease_id))
            self.lease_id = None
        await close_client(self._client, self._call_timeout_s)

    async def _run(self) -> None:
        while True:
            await self._guarded(self._watch_and_tick())
            await asyncio.sleep(self._retry_s)

    async def _watch_and_tick(self) -> None:
        """Campaign, then on every change of the key and every tick, until etcd fails."""
        revision = await self._tick()
        watch = await self._call(self._client.watch(self._key, start_revision=revision + 1))
        consume = asyncio.ensure_future(self._consume(watch))
        try:
            while True:
                changed = asyncio.ensure_future(self._changed.wait())
                await asyncio.wait({consume, changed}, timeout=self.ttl_s / 3,
                                   return_when=asyncio.FIRST_COMPLETED)
                changed.cancel()
                if consume.done():
                    consume.result()
                    raise ConnectionError("etcd watch stream ended")
                self._changed.clear()
                await self._tick()
        finally:
            consume.cancel()
            await asyncio.gather(consume, return_exceptions=True)
            with contextlib.suppress(*ETCD_ERRORS):
                await self._call(watch.cancel())

    async def _consume(self, watch: Any) -> None:
        async for event in watch:
            self._seen_revision = max(self._seen_revision, event.kv.mod_revision)
            if event.kind == aetcd.EventKind.DELETE:
                self._lose("the key was deleted (its lease was revoked or expired)")
            elif event.kv.lease != self.lease_id:
                self._lose(f"{event.kv.value.decode(errors='replace')} holds the key")
            self._changed.set()

    async def _tick(self) -> int:
        """Keep the lease alive (a new one if it is gone), then campaign; returns the
        store's revision."""
        if self.lease_id is None or not await self._keepalive():
            await self._grant()
        revision = await self._campaign()
        if self._outage_logged:
            logger.info("etcd %s reachable again", self._url)
        self._outage_logged = False
        return revision

    async def _keepalive(self) -> bool:
        assert self.lease_id is not None
        sent = self._clock()
        reply = await self._call(refresh_lease_once(self._client, self.lease_id))
        if reply.TTL <= 0:
            self._lose("its lease expired")
            self.lease_id = None
            return False
        self._lease_until = sent + reply.TTL - self._margin_s
        return True

    async def _grant(self) -> None:
        sent = self._clock()
        lease = await self._call(self._client.lease(self.ttl_s))
        self.lease_id = lease.id
        self._lease_until = sent + lease.ttl - self._margin_s

    async def _campaign(self) -> int:
        tx = self._client.transactions
        _, responses = await self._call(self._client.transaction(
            compare=[tx.create(self._key) == 0],
            success=[tx.put(self._key, self.candidate_id.encode(), lease=self.lease_id),
                     tx.get(self._key)],
            failure=[tx.get(self._key)]))
        ((value, kv),) = responses[-1]  # the key exists: it was there, or just put
        revision: int = kv.header.revision
        if revision < self._seen_revision:
            return revision  # the watch saw a later change: ``_changed`` campaigns again
        self.leader_id = value.decode(errors="replace")
        if kv.lease == self.lease_id and not self._holds_key:
            self._holds_key = True
            self.num_terms += 1
            logger.info("leading the planner as %s (%s, lease %x, TTL %ds)", self.candidate_id,
                        self._key.decode(), self.lease_id, self.ttl_s)
        elif kv.lease != self.lease_id:
            self._lose(f"{self.leader_id} holds the key")
        return revision

    def _lose(self, why: str) -> None:
        if self._holds_key:
            logger.warning("no longer leading the planner: %s", why)
        self._holds_key = False

    async def _guarded(self, work: Awaitable[Any]) -> None:
        """Run ``work``; an etcd outage is logged once and left to the next attempt (the
        leadership lapses by itself when the lease's TTL passes unconfirmed)."""
        try:
            await work
        except ETCD_ERRORS as exc:
            await renew_if_unauthenticated(self._client, exc, self._call_timeout_s)
            if not self._outage_logged:
                logger.warning("etcd %s %s (%s: %s); the planner's leadership lapses with the "
                               "lease, retrying", self._url, outage(exc), type(exc).__name__,
                               exc)
            self._outage_logged = True

    async def _call(self, aw: Awaitable[T]) -> T:
        """Every etcd call has a deadline (aetcd's own, and this one as a backstop)."""
        return await bounded(aw, self._call_timeout_s + 1)
