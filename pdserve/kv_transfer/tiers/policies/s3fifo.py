"""S3-FIFO (Yang et al., SOSP'23) with a long ghost: three FIFO queues.

A new key enters a small queue (10 % of the tier). When the small queue is over its
share, its oldest key moves to the main queue if it was accessed while there, or is
evicted, its key kept in a ghost queue (keys only). A key saved again while still a
ghost goes straight to main. Main evicts its oldest key unless it was accessed since
it came round last (then it goes back in, its count less one: a 2-bit CLOCK).

The ghost holds ``ghost`` × the tier's keys (4×), not the paper's 1×: a KV prefix comes
back when its conversation's next turn does, minutes and many tier-fulls of blocks
later (Mooncake's conversation trace: most reuse 256–2,048 requests apart), and a
ghost of one tier-full forgets it first. Main then holds blocks seen twice within that
horizon, kept there long, instead of the newest blocks an LRU holds for a few seconds.
Every operation is O(1) amortised: a key is moved between queues at most a bounded
number of times per access.
"""

from __future__ import annotations

from collections import OrderedDict
from itertools import chain

from pdserve.kv_transfer.tiers.policy import Evictable, Key

_MAX_FREQ = 3


class S3FifoPolicy:
    def __init__(self, capacity: int, small: float = 0.1, ghost: float = 4.0) -> None:
        if capacity <= 0 or not 0 < small < 1 or ghost < 0:
            raise ValueError("s3fifo needs capacity > 0, small in (0, 1), ghost >= 0")
        self.capacity = capacity
        self._small_slots = max(round(capacity * small), 1)
        self._ghost_slots = round(capacity * ghost)
        self._small: OrderedDict[Key, None] = OrderedDict()  # oldest first
        self._main: OrderedDict[Key, None] = OrderedDict()
        self._ghost: OrderedDict[Key, None] = OrderedDict()
        self._freq: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self._small) + len(self._main)

    def holds(self, key: Key) -> bool:
        return key in self._freq

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        if key in self._freq:
            return
        self._freq[key] = 0
        if self._ghost.pop(key, 0) is None:
            self._main[key] = None
        else:
            self._small[key] = None

    def record_access(self, key: Key, now: float) -> None:
        freq = self._freq.get(key)
        if freq is not None and freq < _MAX_FREQ:
            self._freq[key] = freq + 1

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        return True

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        # Each key is looked at a bounded number of times (its count only falls), so
        # the loop ends; a pinned key is passed over and kept in place.
        budget = (_MAX_FREQ + 2) * len(self)
        while budget > 0 and (self._small or self._main):
            budget -= 1
            from_small = len(self._small) >= self._small_slots or not self._main
            queue = self._small if from_small else self._main
            key = next(iter(queue))
            freq = self._freq[key]
            if not evictable(key):
                queue.move_to_end(key)
                continue
            if from_small and freq > 0:
                del self._small[key]
                self._main[key] = None
                self._freq[key] = 0
            elif not from_small and freq > 0:
                queue.move_to_end(key)
                self._freq[key] = freq - 1
            else:
                return key
        # Only pinned keys were met within the budget: any evictable one, oldest first.
        return next((k for k in chain(self._small, self._main) if evictable(k)), None)

    def on_remove(self, key: Key) -> None:
        if self._freq.pop(key, None) is None:
            return
        if self._small.pop(key, 0) is None:
            self._ghost[key] = None
            if len(self._ghost) > self._ghost_slots:
                self._ghost.popitem(last=False)
        else:
            del self._main[key]

    def expired(self, now: float) -> list[Key]:
        return []
