"""etcd membership, router side: list, then watch from the listed revision.

While etcd is unreachable the sink keeps its last-known set; the outage is
logged once, ``pdserve:membership_etcd_up`` drops to 0, and on reconnect
the whole prefix is listed again (``..._etcd_reconnects_total``). A liveness probe
(``Status`` with a deadline) runs beside the watch, because a watch stream to a
hung (not dead) etcd may never fail by itself.

With the cluster secret, only entries whose MAC verifies are read (``signed.py``); the
others are ignored, counted and logged (``note_refusal``, plane ``membership``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import aetcd
import grpc
from aetcd import exceptions as aetcd_exceptions
from aetcd import rpc as aetcd_rpc
from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.core.bounded import bounded
from pdserve.core.cluster_secret import ClusterSecret, note_refusal
from pdserve.core.grpc_tls import TlsFiles
from pdserve.membership.base import MembershipSink, WorkerInfo, workers_prefix
from pdserve.membership.etcd_client import (
    DEFAULT_CALL_TIMEOUT_S,
    EtcdAuth,
    check_etcd_url,
    etcd_client,
)
from pdserve.membership.signed import unverified

logger = logging.getLogger("pdserve.membership.etcd")

# What a failed etcd call raises through aetcd (it maps gRPC errors to ClientError).
ETCD_ERRORS = (aetcd.ClientError, grpc.aio.AioRpcError, asyncio.TimeoutError, OSError,
               ConnectionError)


async def refresh_lease_once(client: aetcd.Client, lease_id: int) -> Any:
    """One LeaseKeepAlive round trip, then the stream is closed.

    aetcd's ``refresh_lease`` returns from inside the stream's iteration and leaves
    the stream open on etcd until garbage collection: one leaked stream per
    keepalive. Returns etcd's reply (``TTL <= 0`` once the lease is gone).
    """
    await client.connect()
    call = client.leasestub.LeaseKeepAlive(
        iter([aetcd_rpc.LeaseKeepAliveRequest(ID=lease_id)]),
        timeout=client._timeout, metadata=client.metadata)
    try:
        reply = await call.read()
    except grpc.aio.AioRpcError as exc:
        aetcd_exceptions._handle_exception(exc)  # raises aetcd's ClientError subclass
        raise
    finally:
        call.cancel()
    if reply is grpc.aio.EOF:
        raise aetcd.ClientError("etcd closed the lease keepalive stream without a reply")
    return reply


# What etcd says when it refuses a client's user/password auth (or its lack).
_REFUSED_CREDENTIALS = ("user name is empty", "authentication failed", "invalid auth token",
                        "permission denied", "authentication is not enabled")


def outage(exc: BaseException) -> str:
    """How a failed etcd call reads in the log: its credentials refused, or unreachable."""
    if any(text in str(exc) for text in _REFUSED_CREDENTIALS):
        return "refused our credentials (check --etcd-user and --etcd-password-file)"
    return "unreachable"


async def renew_if_unauthenticated(client: aetcd.Client, exc: BaseException,
                                   timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
    """After a call failed UNAUTHENTICATED (an expired or invalidated etcd auth token),
    drop the connection: the next call connects and authenticates again."""
    if isinstance(exc, aetcd_exceptions.UnauthenticatedError):
        await close_client(client, timeout_s)


async def close_client(client: aetcd.Client, timeout_s: float = DEFAULT_CALL_TIMEOUT_S) -> None:
    with contextlib.suppress(*ETCD_ERRORS):
        await bounded(client.close(), timeout_s)


class EtcdMembershipMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.up = Gauge("pdserve:membership_etcd_up",
                        "1 while the router's etcd watch is live, 0 while it serves its "
                        "last-known worker set.", registry=registry)
        self.reconnects = Counter("pdserve:membership_etcd_reconnects",
                                  "Re-listings of the worker set after etcd was unreachable.",
                                  registry=registry)
        self.events = Counter("pdserve:membership_events",
                              "Membership changes seen in etcd, by kind (put, delete).",
                              ["kind"], registry=registry)


class EtcdMembership:
    name = "etcd"

    def __init__(self, url: str, cluster: str = "default", *,
                 registry: CollectorRegistry | None = None,
                 call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                 probe_interval_s: float = 1.0, retry_s: float = 0.5,
                 tls: TlsFiles | None = None, secret: ClusterSecret | None = None,
                 auth: EtcdAuth | None = None) -> None:
        self._tls_on = check_etcd_url(url, tls).tls
        self._secret = secret
        self._auth = auth
        self._url = url
        self._tls = tls
        self._cluster = cluster
        self._prefix = workers_prefix(cluster)
        self._call_timeout_s = call_timeout_s
        self._probe_interval_s = probe_interval_s
        self._retry_s = retry_s
        self._metrics = EtcdMembershipMetrics(registry)
        self.connected = False
        self._outage_logged = False
        self.num_listings = 0
        self.revision = 0

    def describe(self) -> dict[str, object]:
        return {"kind": self.name, "url": self._url, "tls": self._tls_on,
                "cluster": self._cluster, "connected": self.connected, "revision": self.revision,
                "num_listings": self.num_listings}

    async def run(self, sink: MembershipSink) -> None:
        while True:
            client = etcd_client(self._url, self._call_timeout_s, self._tls, self._auth)
            try:
                await self._list_and_watch(client, sink)
            except ETCD_ERRORS as exc:
                self._set_connected(False, f"{type(exc).__name__}: {exc}", outage(exc))
            finally:
                await close_client(client, self._call_timeout_s)
            await asyncio.sleep(self._retry_s)

    async def _list_and_watch(self, client: aetcd.Client, sink: MembershipSink) -> None:
        prefix = self._prefix.encode()
        listing = await client.get_prefix(prefix)
        infos = [info for kv in listing if (info := self._parse(kv.key, kv.value))]
        self.revision = listing.header.revision
        watch = await client.watch_prefix(prefix, start_revision=self.revision + 1)
        await sink.replace_all(infos)
        if self.num_listings:
            self._metrics.reconnects.inc()
        self.num_listings += 1
        self._set_connected(True, f"{len(infos)} workers at revision {self.revision}")
        consume = asyncio.ensure_future(self._consume(watch, sink))
        probe = asyncio.ensure_future(self._probe(client))
        try:
            done, _ = await asyncio.wait({consume, probe}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
            raise ConnectionError("etcd watch stream ended")
        finally:
            for task in (consume, probe):
                task.cancel()
            await asyncio.gather(consume, probe, return_exceptions=True)

    async def _consume(self, watch: aetcd.rtypes.Watch, sink: MembershipSink) -> None:
        async for event in watch:
            self.revision = max(self.revision, event.kv.mod_revision)
            if event.kind == aetcd.EventKind.PUT:
                self._metrics.events.labels("put").inc()
                info = self._parse(event.kv.key, event.kv.value)
                if info is not None:
                    await sink.put(info)
            else:
                self._metrics.events.labels("delete").inc()
                await sink.delete(event.kv.key.decode().removeprefix(self._prefix))

    async def _probe(self, client: aetcd.Client) -> None:
        while True:
            await asyncio.sleep(self._probe_interval_s)
            await bounded(client.status(), self._call_timeout_s + 1)

    def _parse(self, key: bytes, value: bytes) -> WorkerInfo | None:
        refused = unverified(self._secret, key.decode(errors="replace"), value)
        if refused is not None:
            note_refusal("membership", refused, key.decode(errors="replace"))
            return None
        try:
            info = WorkerInfo.from_json(value)
        except (ValueError, TypeError, RecursionError) as exc:  # (deeply nested JSON)
            logger.warning("ignoring bad registration at %s: %s", key.decode(errors="replace"),
                           exc)
            return None
        if key.decode(errors="replace") != self._prefix + info.member_id:
            logger.warning("ignoring registration %s: its key does not match %s",
                           key.decode(errors="replace"), info.member_id)
            return None
        return info

    def _set_connected(self, connected: bool, detail: str, what: str = "unreachable") -> None:
        """Log each transition once: one warning per outage, one line on recovery."""
        if connected and not self.connected:
            logger.info("etcd %s: watching %s (%s)", self._url, self._prefix, detail)
        elif not connected and not self._outage_logged:
            logger.warning("etcd %s %s (%s); keeping the last-known worker set, "
                           "retrying every %.1fs", self._url, what, detail, self._retry_s)
        self._outage_logged = not connected
        self.connected = connected
        self._metrics.up.set(1 if connected else 0)
