"""A prefill worker's authoritative mirror of its engine's prefix-cached blocks,
and the fan-out of its changes to subscribers (the routers).

Blocks are pdserve chained hashes (``pdserve.core.block_hash``). Changes come in as
``apply`` calls (from vLLM's KV events, or from the simulated worker) and leave
as numbered ``KvChange`` batches: seq 1, 2, 3... A subscriber whose queue
overflows loses batches and sees the jump in seq, which tells it to resync from
``snapshot()``. Everything here runs on the worker's event loop thread.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable

from pdserve.core.types import KvChange


class KvSubscription:
    """One subscriber's bounded queue. Overflow drops batches (the seq jump says so)."""

    def __init__(self, mirror: KvCacheMirror, max_queue: int) -> None:
        self._mirror = mirror
        self._queue: asyncio.Queue[KvChange] = asyncio.Queue(max_queue)
        self.num_dropped = 0

    def offer(self, change: KvChange) -> None:
        try:
            self._queue.put_nowait(change)
        except asyncio.QueueFull:
            self.num_dropped += 1

    async def next(self, timeout_s: float) -> KvChange:
        """The next batch, or a heartbeat (the mirror's current seq) after ``timeout_s``."""
        try:
            return await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return KvChange(self._mirror.seq)

    def close(self) -> None:
        self._mirror.unsubscribe(self)


class KvCacheMirror:
    """The set of cached blocks, with a reference count per hash (two engine blocks
    may share a pdserve hash); a hash is in the set while its count is > 0."""

    def __init__(self, block_size: int, max_queue: int = 10_000) -> None:
        self.block_size = block_size
        self.seq = 0
        self._counts: Counter[int] = Counter()
        self._subscribers: set[KvSubscription] = set()
        self._max_queue = max_queue

    def __len__(self) -> int:
        return len(self._counts)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._counts

    def apply(self, cleared: bool, stored: Iterable[int], removed: Iterable[int]
              ) -> KvChange | None:
        """Apply engine changes; publish the resulting set changes (None if none)."""
        if cleared:
            self._counts.clear()
        added = [h for h in stored if self._incr(h)]
        gone = [h for h in removed if self._decr(h)]
        if not (cleared or added or gone):
            return None
        self.seq += 1
        change = KvChange(self.seq, cleared, tuple(added), tuple(gone))
        for sub in self._subscribers:
            sub.offer(change)
        return change

    def snapshot(self) -> tuple[int, list[int]]:
        """(seq of the last applied batch, every cached hash)."""
        return self.seq, list(self._counts)

    def subscribe(self, max_queue: int | None = None) -> KvSubscription:
        sub = KvSubscription(self, max_queue or self._max_queue)
        self._subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: KvSubscription) -> None:
        self._subscribers.discard(sub)

    def _incr(self, h: int) -> bool:
        self._counts[h] += 1
        return self._counts[h] == 1

    def _decr(self, h: int) -> bool:
        n = self._counts.get(h, 0)
        if n <= 0:
            return False
        if n == 1:
            del self._counts[h]
            return True
        self._counts[h] = n - 1
        return False
