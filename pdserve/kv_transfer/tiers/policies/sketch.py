"""A count-min sketch of how often keys were asked for, with aging: TinyLFU's
frequency estimate. Four rows of 4-bit counters (capped at 15); after ``sample``
increments every counter is halved, so old popularity fades. Keys are hashed from
their bytes, not Python's salted ``hash``, so a replay gives the same numbers every run."""

from __future__ import annotations

_ROWS = 4
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93)
_MASK64 = (1 << 64) - 1
_MAX = 15


class CountMinSketch:
    def __init__(self, capacity: int, sample_factor: int = 10) -> None:
        width = 1
        while width < max(capacity, 16):
            width <<= 1
        self._width = width
        self._counts = [0] * (width * _ROWS)
        self._sample = max(capacity, 1) * sample_factor
        self._added = 0

    def _cells(self, key: bytes) -> list[int]:
        h = int.from_bytes(key[:8], "little")  # block hashes: random bytes; same every run
        w = self._width
        return [row * w + ((((h * seed) & _MASK64) >> 32) & (w - 1))
                for row, seed in enumerate(_SEEDS)]

    def estimate(self, key: bytes) -> int:
        counts = self._counts
        return min(counts[c] for c in self._cells(key))

    def add(self, key: bytes) -> None:
        counts = self._counts
        for c in self._cells(key):
            if counts[c] < _MAX:
                counts[c] += 1
        self._added += 1
        if self._added >= self._sample:
            self._counts = [c >> 1 for c in counts]
            self._added //= 2
