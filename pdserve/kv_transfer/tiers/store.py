"""The KV tiers on the connector's worker side: the host tier's memory and the disk
tier's files, the copies between them and the engine's cache, and their counters.

Saves and loads run on the connector's pull threads. A save writes a finished
request's blocks through to each tier the scheduler side named (host, then disk); a
save that fails leaves its slots unreadable (counted, logged; the block is recomputed
when next asked for). A load copies from each tier into the blocks vLLM allocated and
raises ``TransferError`` when any part fails (counted), which vLLM answers by
recomputing the prompt.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.metadata import TierCopy
from pdserve.kv_transfer.reported import TIER_STATS
from pdserve.kv_transfer.tiers.disk import DiskTier
from pdserve.kv_transfer.tiers.host import HostTier

logger = logging.getLogger("pdserve.kv_transfer.tiers")

# The counters a TierStore keeps; the worker side keeps the pool's loads and the
# scheduler side's counts.
_OWN = (*TIER_STATS[:14], "pool_serves", "pool_serve_blocks", "pool_serve_failures",
        "tier_load_bytes", "disk_load_bytes")


class _Serve:
    """One peer's pool pull from the host tier (``pool_pull.PoolServe``), counted at its end."""

    def __init__(self, store: TierStore, chunks: list[torch.Tensor],
                 blocks: list[list[torch.Tensor]], unchanged: Callable[[], bool]) -> None:
        self.chunks = chunks
        self.blocks = blocks
        self.unchanged = unchanged
        self._store = store
        self._num_blocks = len(blocks)

    def finish(self, ok: bool) -> None:
        if ok:
            self._store._count(pool_serves=1, pool_serve_blocks=self._num_blocks)
        else:
            self._store._count(pool_serve_failures=1)


class TierStore:
    def __init__(self, kv: list[torch.Tensor], layout: KVLayout, host_slots: int,
                 verify: bool, disk_dir: str | None, disk_compat: str) -> None:
        self.host = HostTier(kv, layout, host_slots, verify) if host_slots else None
        self.disk = DiskTier(Path(disk_dir), disk_compat, kv, layout) if disk_dir else None
        self._stats = dict.fromkeys(_OWN, 0)
        self._lock = threading.Lock()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def save(self, req_id: str, host: TierCopy, disk: TierCopy) -> int:
        """Write ``req_id``'s blocks to the tiers; the bytes written. Never raises."""
        return (self._save("tier", self.host, req_id, host)
                + self._save("disk", self.disk, req_id, disk))

    def load(self, req_id: str, host: TierCopy, disk: TierCopy) -> int:
        """Copy ``req_id``'s blocks from the tiers; the bytes copied, or ``TransferError``."""
        return (self._load("tier", self.host, req_id, host)
                + self._load("disk", self.disk, req_id, disk))

    def serve(self, hashes: list[bytes]) -> _Serve:
        """A peer's pool pull of ``hashes`` from the host tier; ``TransferError`` (counted)
        when this worker has no host tier or does not hold one of them."""
        try:
            if self.host is None:
                raise TransferError("no host tier on this worker")
            chunks, blocks, unchanged = self.host.serve(hashes)
        except TransferError:
            self._count(pool_serve_failures=1)
            raise
        return _Serve(self, chunks, blocks, unchanged)

    def _save(self, tier: str, store: Any, req_id: str, copy: TierCopy) -> int:
        if not copy.slots or store is None:
            return 0
        try:
            nbytes = int(store.save(copy.block_ids, copy.slots, copy.hashes))
        except Exception:  # noqa: BLE001 - a full disk, say: the block is not held
            self._count(**{f"{tier}_save_failures": 1})
            logger.exception("%s tier save for %s failed", tier, req_id)
            return 0
        self._count(**{f"{tier}_saves": 1, f"{tier}_save_blocks": len(copy.slots)})
        return nbytes

    def _load(self, tier: str, store: Any, req_id: str, copy: TierCopy) -> int:
        if not copy.slots:
            return 0
        start = time.perf_counter_ns()
        try:
            if store is None:
                raise TransferError(f"no {tier} tier here")
            nbytes = int(store.load(copy.slots, copy.block_ids, copy.hashes))
        except TransferError as exc:
            self._count(**{f"{tier}_load_failures": 1})
            logger.warning("%s tier load for %s failed, recomputing: %s", tier, req_id, exc)
            raise
        self._count(**{f"{tier}_loads": 1, f"{tier}_load_blocks": len(copy.slots),
                       f"{tier}_load_time_ns": time.perf_counter_ns() - start,
                       f"{tier}_load_bytes": nbytes})
        return nbytes

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._stats[key] += value
