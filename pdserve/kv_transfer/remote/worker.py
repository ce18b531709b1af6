"""The cluster KV store on the connector's worker side: blocks loaded from the store into
the engine's cache, and a finished request's blocks copied out and published behind it.

A load gets the planned blocks in one round trip, checks each (the value's CRC, the
encoding's header: ``codec.py``, ``compression``), and writes them into the blocks vLLM
allocated, in order, up to the first block missing (expired, evicted since the lookup)
or bad: that block and every one after it are not loaded, and the load says how many
were (the connector reports the rest to vLLM, which recomputes from there and keeps the
prefix). A store that fails loads none. A value whose encoding does not decode is
deleted from the store (``KVStore.discard``; the store deletes one whose checksum is
wrong itself), so the next writer can publish a good one. A save copies the blocks'
bytes out of the cache on the pull threads (the blocks stay allocated until it
returns), then hands them to one writer thread that publishes them (``SET NX``, with the
TTL): the request's blocks are released at once and no request waits for the store.
The writer's queue is bounded (``QUEUE_BYTES``); a save that does not fit is dropped
and counted.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence

import torch

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.metadata import StoreCopy
from pdserve.kv_transfer.remote.base import KVStore, StoreError
from pdserve.kv_transfer.remote.compression import BlockCodec
from pdserve.kv_transfer.remote.names import BlockName

logger = logging.getLogger("pdserve.kv_transfer.store")

QUEUE_BYTES = 256 << 20  # copied-out blocks waiting for the writer, at most

STATS = ("store_loads", "store_load_blocks", "store_load_bytes", "store_load_time_ns",
         "store_load_failures", "store_load_missing", "store_bad_blocks", "store_timeouts",
         "store_saves", "store_save_blocks", "store_save_bytes", "store_save_dropped",
         "store_put_blocks", "store_put_written", "store_put_failures")


class StoreWorker:
    def __init__(self, open_store: Callable[[], KVStore], kv: Sequence[torch.Tensor],
                 layout: KVLayout, codec: BlockCodec, ttl_s: float) -> None:
        self._open = open_store  # connected on first use: a store down at start is a miss
        self._client: KVStore | None = None
        self._kv = list(kv)
        self._dims = [lay.block_dim for lay in layout.layers]
        self._codec = codec
        self._ttl_s = ttl_s
        self._stats = dict.fromkeys(STATS, 0)
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[list[tuple[BlockName, bytes]], int] | None] = (
            queue.Queue())
        self._queued_bytes = 0
        self._feedback_loads: list[tuple[int, int]] = []
        self._unpublished: list[str] = []
        self._published: list[tuple[str, int]] = []
        self._raw_block_bytes = sum(t.select(d, 0).nbytes for t, d in zip(
            self._kv, self._dims, strict=True))
        self._writer = threading.Thread(target=self._write_loop, name="pdserve-kv-store-put",
                                        daemon=True)
        self._writer.start()

    def _store(self) -> KVStore:
        """The client, connected now if it is not yet (``StoreError`` if it cannot be)."""
        with self._lock:
            client = self._client
        if client is None:
            client = self._open()
            with self._lock:
                if self._client is None:
                    self._client = client
                else:  # another thread connected meanwhile
                    client.close()
                    client = self._client
        return client

    def _block(self, block_id: int) -> list[torch.Tensor]:
        return [kv.select(dim, block_id) for kv, dim in zip(self._kv, self._dims, strict=True)]

    def load(self, req_id: str, copy: StoreCopy) -> tuple[int, int]:
        """Copy the blocks ``copy`` names from the store into its ``block_ids``, in order,
        up to the first one missing or bad; (bytes read, blocks loaded). Never raises for
        the store: one that fails loads none (counted)."""
        start = time.perf_counter_ns()
        try:
            payloads = self._store().get_blocks(copy.names)
        except StoreError as exc:
            self._count(store_load_failures=1)
            logger.warning("KV store load for %s failed, computing its %d blocks: %s",
                           req_id, len(copy.names), exc)
            return 0, 0
        nbytes, loaded = self._write_blocks(copy, payloads)
        elapsed = time.perf_counter_ns() - start
        if loaded < len(copy.names):
            self._count(store_load_failures=1)
            logger.warning("KV store load for %s: %d of %d blocks loaded, computing the rest",
                           req_id, loaded, len(copy.names))
        if loaded:
            self._count(store_loads=1, store_load_blocks=loaded, store_load_bytes=nbytes,
                        store_load_time_ns=elapsed)
            with self._lock:  # the decision weighs the blocks' bytes in the cache
                self._feedback_loads.append((loaded * self._raw_block_bytes, elapsed))
        return nbytes, loaded

    def _write_blocks(self, copy: StoreCopy, payloads: list[memoryview | None]
                      ) -> tuple[int, int]:
        """Decode the leading blocks present into the cache; (bytes, blocks) written."""
        self._count(store_load_missing=sum(p is None for p in payloads))
        nbytes = loaded = 0
        for block_id, name, payload in zip(copy.block_ids, copy.names, payloads, strict=True):
            if payload is None:
                break
            try:
                self._codec.decode(payload, self._block(block_id))
            except ValueError as exc:
                self._count(store_bad_blocks=1, store_load_missing=1)
                logger.warning("KV store block %s does not decode, deleting it: %s",
                               name.key, exc)
                self._discard(name, payload)
                break
            nbytes += len(payload)
            loaded += 1
        if loaded and self._kv and self._kv[0].device.type == "cuda":
            torch.cuda.synchronize(self._kv[0].device)
        return nbytes, loaded

    def _discard(self, name: BlockName, payload: memoryview) -> None:
        """Delete a value that passed its checksum but not its encoding (best effort)."""
        try:
            self._store().discard([(name, payload)])
        except StoreError as exc:
            logger.warning("KV store: could not delete bad block %s: %s", name.key, exc)

    def save(self, req_id: str, copy: StoreCopy) -> int:
        """Copy the blocks out of the cache and queue them for the writer; the bytes
        queued (0: dropped, the queue is full). Never raises."""
        with self._lock:  # the longest prefix of the blocks that fits the writer's queue
            room = (QUEUE_BYTES - self._queued_bytes) // max(self._raw_block_bytes, 1)
        fits = min(len(copy.names), max(room, 0))
        if fits < len(copy.names):
            self._count(store_save_dropped=len(copy.names) - fits)
        items: list[tuple[BlockName, bytes]] = []
        for block_id, name in zip(copy.block_ids[:fits], copy.names[:fits], strict=True):
            try:
                items.append((name, self._codec.encode(self._block(block_id))))
            except ValueError as exc:  # a lossy codec refuses NaN/inf: not published,
                logger.warning("KV store save for %s stops at a block: %s", req_id, exc)
                break  # nor the blocks after it (a prefix ends at its first hole)
        self._unpublish(copy.names[len(items):])
        if not items:
            return 0
        with self._lock:
            nbytes = sum(len(p) for _, p in items)
            while items and self._queued_bytes + nbytes > QUEUE_BYTES:  # encoded: larger
                name, payload = items.pop()  # the prefix stays
                nbytes -= len(payload)
                self._stats["store_save_dropped"] += 1
                self._unpublished.append(name.key)
            if not items:
                return 0
            self._queued_bytes += nbytes
            self._stats["store_saves"] += 1
            self._stats["store_save_blocks"] += len(items)
            self._stats["store_save_bytes"] += nbytes
        self._queue.put((items, nbytes))
        return nbytes

    def _write_loop(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            items, nbytes = job
            try:
                written = self._store().put_blocks(items, self._ttl_s)
                self._count(store_put_blocks=len(items), store_put_written=written)
                with self._lock:  # held now (written, or another worker's first)
                    self._published.extend((n.key, n.block_hash) for n, _ in items)
            except Exception as exc:  # noqa: BLE001 - the writer outlives any failure
                self._count(store_put_failures=1)
                self._unpublish(tuple(n for n, _ in items))
                logger.warning("KV store publish of %d blocks failed: %s", len(items), exc)
            finally:
                with self._lock:
                    self._queued_bytes -= nbytes

    def _unpublish(self, names: Sequence[BlockName]) -> None:
        with self._lock:
            self._unpublished.extend(n.key for n in names)

    def take_feedback(self) -> tuple[list[tuple[int, int]], list[str], list[tuple[str, int]]]:
        """Loads that ended, keys not published and blocks published, since the last
        call."""
        with self._lock:
            loads, self._feedback_loads = self._feedback_loads, []
            unpublished, self._unpublished = self._unpublished, []
            published, self._published = self._published, []
        return loads, unpublished, published

    def stats(self) -> dict[str, int]:
        """This side's counters; a bad block is one the store's checksum refused (the
        client counts those) or whose encoding did not decode; ``store_bad_deleted``:
        bad values the client deleted from the store."""
        with self._lock:
            out = dict(self._stats)
            client = self._client.stats() if self._client is not None else {}
        out["store_bad_blocks"] += client.get("bad_blocks", 0)
        out["store_bad_deleted"] = client.get("bad_deleted", 0)
        out["store_timeouts"] += client.get("timeouts", 0)
        return out

    def flush(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the writer's queue to empty (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if self._queued_bytes == 0:
                    return True
            time.sleep(0.01)
        return False

    def close(self) -> None:
        self._queue.put(None)
        self._writer.join(timeout=2.0)
        if self._client is not None:
            self._client.close()

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._stats[key] += value
