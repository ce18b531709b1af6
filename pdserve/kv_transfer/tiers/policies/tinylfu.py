"""W-TinyLFU (Einziger, Friedman, Manes): a small LRU window that admits every new
key, in front of a segmented LRU main space (probation, then protected once hit
again). When the window overflows, its oldest key competes with main's next victim
and the one asked for more often (a count-min sketch with aging) stays.

``AdaptiveTinyLfuPolicy`` tunes the window's share by hill climbing (Caffeine's
scheme): every sample of accesses it moves the window by a step, keeps the direction
while the hit ratio improves and turns back when it drops; the step shrinks as it
settles. A window of the whole tier is LRU; a small one protects frequent blocks from
a scan of one-off blocks.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from pdserve.kv_transfer.tiers.policies.sketch import CountMinSketch
from pdserve.kv_transfer.tiers.policy import Evictable, Key


def _oldest(order: OrderedDict[Key, None], evictable: Evictable) -> Key | None:
    return next((k for k in order if evictable(k)), None)


class TinyLfuPolicy:
    def __init__(self, capacity: int, window: float = 0.01, protected: float = 0.8) -> None:
        if capacity <= 0 or not 0 <= window <= 1 or not 0 <= protected <= 1:
            raise ValueError("wtinylfu needs capacity > 0 and shares in [0, 1]")
        self.capacity = capacity
        self._protected_share = protected
        self.window_slots = round(capacity * window)
        self.sketch = CountMinSketch(capacity)
        self._window: OrderedDict[Key, None] = OrderedDict()
        self._probation: OrderedDict[Key, None] = OrderedDict()
        self._protected: OrderedDict[Key, None] = OrderedDict()
        # Keys the window pushed into probation, oldest first, not yet judged against
        # main's victim (a tier saves a request's blocks after choosing all victims).
        self._candidates: deque[Key] = deque()

    def __len__(self) -> int:
        return len(self._window) + len(self._probation) + len(self._protected)

    def holds(self, key: Key) -> bool:
        return key in self._window or key in self._probation or key in self._protected

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        self._window[key] = None
        self._rebalance()

    def record_access(self, key: Key, now: float) -> None:
        self.sketch.add(key)
        if key in self._window:
            self._window.move_to_end(key)
        elif key in self._protected:
            self._protected.move_to_end(key)
        elif key in self._probation:
            del self._probation[key]
            self._protected[key] = None
            self._rebalance()

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        self.sketch.add(key)
        return True

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        candidate = self._candidate(evictable)
        if candidate is None:
            return (_oldest(self._probation, evictable) or _oldest(self._protected, evictable)
                    or _oldest(self._window, evictable))
        self._candidates.popleft()
        main = next((k for k in self._probation if k != candidate and evictable(k)), None)
        if main is None:
            main = _oldest(self._protected, evictable)
        # The window's pushed-out key stays only if asked for more often than main's victim.
        if main is None or self.sketch.estimate(candidate) <= self.sketch.estimate(main):
            return candidate
        return main

    def _candidate(self, evictable: Evictable) -> Key | None:
        while self._candidates:
            key = self._candidates[0]
            if key in self._probation and evictable(key):
                return key
            self._candidates.popleft()  # promoted, removed, or pinned: not judged
        return None

    def on_remove(self, key: Key) -> None:
        for part in (self._window, self._probation, self._protected):
            if part.pop(key, 0) is None:
                return

    def expired(self, now: float) -> list[Key]:
        return []

    def _rebalance(self) -> None:
        while len(self._window) > self.window_slots:
            key, _ = self._window.popitem(last=False)
            self._probation[key] = None
            self._candidates.append(key)
        limit = round((self.capacity - self.window_slots) * self._protected_share)
        while len(self._protected) > limit:
            key, _ = self._protected.popitem(last=False)
            self._probation[key] = None


class AdaptiveTinyLfuPolicy(TinyLfuPolicy):
    def __init__(self, capacity: int, window: float = 0.01, sample: int | None = None,
                 step: float = 0.0625, decay: float = 0.98) -> None:
        super().__init__(capacity, window)
        self._sample = sample or max(capacity, 1000)
        self._step = step * capacity
        self._decay = decay
        self._hits = self._misses = 0
        self._last_ratio: float | None = None

    def record_access(self, key: Key, now: float) -> None:
        self._hits += 1
        super().record_access(key, now)
        self._climb()

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        self._misses += 1
        self._climb()
        return super().admit(key, now, tenant)

    def _climb(self) -> None:
        if self._hits + self._misses < self._sample:
            return
        ratio = self._hits / (self._hits + self._misses)
        self._hits = self._misses = 0
        if self._last_ratio is not None and ratio < self._last_ratio:
            self._step = -self._step * self._decay  # worse: turn back, smaller steps
        else:
            self._step *= self._decay
        self._last_ratio = ratio
        slots = round(min(max(self.window_slots + self._step, 0), self.capacity))
        self.window_slots = slots
        self._rebalance()
