"""Belady's optimum as a ``TierPolicy``, for the simulator only (it needs the future):
evict the held block whose next reference is farthest (never again: farthest of
all). References are numbered over the whole trace, request by request, each
request's blocks in prompt order: while request r is replayed, a block r already
touched is next referenced after r; one r has yet to touch, at its place in r (no
request names a block twice, as in Mooncake's traces)."""

from __future__ import annotations

import heapq
from bisect import bisect_left

from pdserve.kv_transfer.tiers.policy import Evictable, Key

NEVER = 1 << 62


class BeladyPolicy:
    def __init__(self, blocks: tuple[tuple[bytes, ...], ...]) -> None:
        self._uses: dict[bytes, list[int]] = {}
        self._starts: list[int] = []
        self._ends: list[int] = []
        pos = 0
        for request in blocks:
            self._starts.append(pos)
            for key in request:
                self._uses.setdefault(key, []).append(pos)
                pos += 1
            self._ends.append(pos)
        self._start = self._end = 0  # the request being replayed: its references
        self._next: dict[Key, int] = {}
        self._heap: list[tuple[int, Key]] = []  # (-next use, key), stale entries skipped

    def at_request(self, index: int) -> None:
        """Request ``index`` is being replayed."""
        self._start, self._end = self._starts[index], self._ends[index]

    def _touch(self, key: Key, after: int | None = None) -> None:
        uses = self._uses.get(key, [])
        i = bisect_left(uses, self._end if after is None else after)
        nxt = uses[i] if i < len(uses) else NEVER
        self._next[key] = nxt
        heapq.heappush(self._heap, (-nxt, key))

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        self._touch(key)

    def record_access(self, key: Key, now: float) -> None:
        if key in self._next:
            self._touch(key)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        return True

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        skipped = []
        found = None
        while self._heap:
            neg, key = heapq.heappop(self._heap)
            if self._next.get(key) != -neg:
                continue  # stale
            if -neg < self._start:  # its next use went by untouched (a save cut short)
                self._touch(key, self._start)
                continue
            skipped.append((neg, key))
            if evictable(key):
                found = key
                break
        for entry in skipped:
            heapq.heappush(self._heap, entry)
        return found

    def on_remove(self, key: Key) -> None:
        self._next.pop(key, None)

    def expired(self, now: float) -> list[Key]:
        return []
