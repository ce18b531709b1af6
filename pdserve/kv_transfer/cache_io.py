"""Where a worker's blocks go and come from beyond the P/D transfer, on the worker side:
its own host and disk tiers, the cluster KV store and a peer's host tier (the pool).

``CacheIO`` runs on the connector's pull pool (never the engine's thread): a finished
request's blocks saved to the tiers and copied out for the store, a new request's
blocks loaded from them in the order they sit in the request. The store loads what it
can; the blocks from its first missing or bad one on are the load's errors, held until
the pass that reports the load finished, then handed to vLLM
(``get_block_ids_with_load_errors``), which recomputes from there.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pdserve.kv_transfer.base import KVTransport, PeerAddress
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.wire import IncompatiblePeerError, TransferError
from pdserve.kv_transfer.metadata import PoolLoad, StoreCopy, StoreFeedback, TierCopy
from pdserve.kv_transfer.remote.worker import StoreWorker
from pdserve.kv_transfer.step_model import StepTimer
from pdserve.kv_transfer.tiers.store import TierStore

logger = logging.getLogger("pdserve.kv_transfer.worker")


class CacheIO:
    """One engine rank's tiers, store and pool pulls; ``count`` adds to the worker
    side's load counters (thread-safe)."""

    def __init__(self, config: ConnectorConfig, tp_rank: int, transport: KVTransport,
                 count: Callable[..., None]) -> None:
        self._config = config
        self._tp_rank = tp_rank
        self._transport = transport
        self._count = count
        self.tiers: TierStore | None = None  # once the KV caches are registered
        self.store: StoreWorker | None = None
        # The store was asked for but this rank turned it off: told once to the
        # scheduler side (``feedback``), which then stops looking up and publishing.
        self.tell_store_off = False
        self._lock = threading.Lock()
        # A load's blocks not loaded (the store's from its first missing one on), until
        # ``loaded`` reports the load, then until vLLM takes them (``take_load_errors``).
        self._load_errors: dict[str, tuple[int, ...]] = {}
        self._reported: set[int] = set()

    def save(self, req_id: str, host: TierCopy | None, disk: TierCopy,
             store: StoreCopy | None) -> int:
        """A finished request's blocks written to this worker's tiers and copied out for
        the store (published behind it); the bytes. Never raises: where a side is off
        (the two sides disagree), nothing is saved there and the save still ends."""
        nbytes = 0
        if host is not None and self.tiers is not None:
            nbytes += self.tiers.save(req_id, host, disk)
        if store is not None and self.store is not None:
            nbytes += self.store.save(req_id, store)
        return nbytes

    def load(self, req_id: str, host: TierCopy | None, disk: TierCopy,
             pool: PoolLoad | None, store: StoreCopy | None = None) -> int:
        """A request's blocks from this worker's tiers, then from the cluster store, then
        from a peer's host tier (the pool), in the order they sit in the request;
        ``TransferError`` if a tier or the pool fails (vLLM then recomputes it all). The
        store loads what it can: the blocks from its first missing or bad one on, the
        pool's after them included (not loaded), are the request's load errors."""
        nbytes = 0
        if host is not None and (host.slots or disk.slots):
            if self.tiers is None:
                raise TransferError("no KV tiers on this worker")
            nbytes += self.tiers.load(req_id, host, disk)
        if store is not None and store.names:
            loaded = 0
            if self.store is not None:
                got, loaded = self.store.load(req_id, store)
                nbytes += got
            if loaded < len(store.names):
                lost = store.block_ids[loaded:] + (pool.block_ids if pool is not None else ())
                with self._lock:
                    self._load_errors[req_id] = lost
                return nbytes
        if pool is not None and pool.hashes:
            nbytes += self._pull_pool(req_id, pool)
        return nbytes

    def loaded(self, req_id: str, failed: bool) -> None:
        """``poll`` reports the request's load: its lost blocks are vLLM's to take (a
        failed load is recomputed whole: nothing to report)."""
        with self._lock:
            lost = self._load_errors.pop(req_id, ())
        if not failed:  # reported in the pass that reports the request (vLLM's contract)
            self._reported.update(lost)

    def take_load_errors(self) -> set[int]:
        """The blocks of the loads reported finished (not failed) that were not loaded,
        since the last call (vLLM's ``get_block_ids_with_load_errors``)."""
        errors, self._reported = self._reported, set()
        return errors

    def feedback(self, steps: StepTimer) -> StoreFeedback | None:
        """What the scheduler side's fetch-or-compute decision learns from this step
        (None without a store, or with nothing new)."""
        if self.store is None:
            if not self.tell_store_off:
                return None
            self.tell_store_off = False  # said once
            return StoreFeedback(store_off=True)
        loads, unpublished, published = self.store.take_feedback()
        estimate = steps.estimate()
        per_token = estimate.per_token_ns if estimate.num_prefill_steps else 0
        if not (loads or unpublished or published or per_token):
            return None
        return StoreFeedback(per_token, loads, unpublished, published)

    def stats(self) -> dict[str, int]:
        out: dict[str, int] = {}
        if self.tiers is not None:
            out.update(self.tiers.stats())
        if self.store is not None:
            out.update(self.store.stats())
        return out

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def _pull_pool(self, req_id: str, pool: PoolLoad) -> int:
        peer = PeerAddress(pool.host, pool.port + self._tp_rank)
        start = time.perf_counter_ns()
        try:
            nbytes = self._transport.pull_pool(
                peer, pool.hashes, pool.block_ids,
                time.monotonic() + self._config.transfer_timeout_s)
        except TransferError as exc:  # refused: the peer's --kv-compression differs
            self._count(pool_load_failures=1, pool_load_refusals=int(
                isinstance(exc, IncompatiblePeerError)))
            logger.warning("KV pool pull for %s from %s failed, recomputing: %s",
                           req_id, peer, exc)
            raise
        self._count(pool_loads=1, pool_load_blocks=len(pool.hashes),
                    pool_load_time_ns=time.perf_counter_ns() - start, pool_load_bytes=nbytes)
        return nbytes
