"""Feeds the prefix index from the workers' KV-event relays.

One ``KvEventFollower`` per worker, prefill and decode, streams ``StreamKvEvents`` and applies
each batch to the index. Batches are numbered; a jump in seq (lost batches), a
heartbeat whose seq differs from the last applied one, or a new stream
(reconnect) makes it resync from ``GetKvSnapshot``. When the stream breaks the
worker's entries are dropped until it resyncs. ``KvIndexFeeder`` follows the
pool's membership: a worker that leaves is removed from the index. Prefill workers'
entries place prefills; decode workers' place decodes (the worker that holds a
conversation's earlier turns) and let a prompt that decode mostly holds be computed
there (``disagg.py``, ``decode_cached``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from prometheus_client import CollectorRegistry

from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.workers.client import UNIMPLEMENTED, WorkerCallError, WorkerClient
from pdserve.router.dispatch.workers.pool import Worker
from pdserve.router.metrics import PREFIX, counter

logger = logging.getLogger("pdserve.router.kv_feed")
_RPC_TIMEOUT_S = 10.0
_UNSUPPORTED_RETRY_S = 15.0


class KvFeedMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.resyncs = counter(registry, f"{PREFIX}kv_events_resyncs", "Prefix-index resyncs "
                               "from a worker's snapshot, by reason.", ["reason"])
        self.batches = counter(registry, f"{PREFIX}kv_events_batches", "KV event batches "
                               "applied to the prefix index.")


class KvEventFollower:
    def __init__(self, client: WorkerClient, index: PrefixIndex, metrics: KvFeedMetrics,
                 retry_s: float = 1.0) -> None:
        self.client = client
        self._index = index
        self._metrics = metrics
        self._retry_s = retry_s
        self.worker_id: str | None = None
        self.last_seq = 0
        self.num_resyncs = 0
        self.unsupported = False

    async def run(self) -> None:
        """Follow until cancelled; reconnect after failures (slowly where the worker
        publishes no KV events: it may be restarted with them)."""
        while True:
            retry_s = self._retry_s
            try:
                await self._follow_once()
            except WorkerCallError as exc:
                if exc.code == UNIMPLEMENTED:
                    if not self.unsupported:
                        logger.info("%s publishes no KV events", self.client.endpoint)
                    self.unsupported = True
                    retry_s = _UNSUPPORTED_RETRY_S
                logger.debug("KV events from %s: %s", self.client.endpoint, exc.code)
            self.forget()
            await asyncio.sleep(retry_s)

    def forget(self) -> None:
        if self.worker_id is not None:
            self._index.remove_worker(self.worker_id)

    async def _follow_once(self) -> None:
        async with contextlib.aclosing(self.client.kv_events()) as changes:
            first = True
            async for batch in changes:
                if first:
                    await self.resync("connect")
                    first = False
                elif batch.is_heartbeat:
                    if batch.seq != self.last_seq:
                        await self.resync("heartbeat")
                elif batch.seq > self.last_seq + 1:
                    await self.resync("gap")
                if batch.seq == self.last_seq + 1 and self.worker_id is not None:
                    self._index.apply(self.worker_id, batch.cleared, batch.stored,
                                      batch.removed)
                    self.last_seq = batch.seq
                    self._metrics.batches.inc()

    async def resync(self, reason: str) -> None:
        snap = await self.client.kv_snapshot(_RPC_TIMEOUT_S)
        if self.worker_id is not None and self.worker_id != snap.worker_id:
            self._index.remove_worker(self.worker_id)  # a new process at the same endpoint
        self.worker_id = snap.worker_id
        self._index.replace(snap.worker_id, snap.block_size, snap.block_hashes)
        self.last_seq = snap.seq
        self.num_resyncs += 1
        self._metrics.resyncs.labels(reason).inc()
        logger.info("prefix index: %s resynced (%s), %d blocks at seq %d", snap.worker_id,
                    reason, len(snap.block_hashes), snap.seq)


class KvIndexFeeder:
    """Keeps one follower per current worker of ``workers`` (membership may change)."""

    def __init__(self, workers: Callable[[], Sequence[Worker]], index: PrefixIndex,
                 registry: CollectorRegistry | None, interval_s: float = 1.0) -> None:
        self._workers = workers
        self._index = index
        self._metrics = KvFeedMetrics(registry)
        self._interval_s = interval_s
        self._tasks: dict[int, tuple[KvEventFollower, asyncio.Task[None]]] = {}
        self._loop_task: asyncio.Task[None] | None = None

    @property
    def followers(self) -> list[KvEventFollower]:
        return [f for f, _ in self._tasks.values()]

    def sync(self) -> None:
        """Start followers for new workers; stop and forget departed ones."""
        current = {id(c): c for c in self._workers()}
        for key in [k for k in self._tasks if k not in current]:
            follower, task = self._tasks.pop(key)
            task.cancel()
            follower.forget()
        for key, worker in current.items():
            if key not in self._tasks:
                follower = KvEventFollower(worker.client, self._index, self._metrics)
                task = asyncio.create_task(follower.run(), name="pdserve-kv-follow")
                self._tasks[key] = (follower, task)

    async def start(self) -> None:
        self.sync()
        self._loop_task = asyncio.create_task(self._loop(), name="pdserve-kv-feed")

    async def close(self) -> None:
        tasks = [t for _, t in self._tasks.values()]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            self.sync()
