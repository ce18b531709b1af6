"""Pending blocks: KV blocks a prefill placed by this router is computing now.

The prefix index learns what a worker holds from its KV events, which arrive only
after the prefill ran. Until then a burst of requests sharing a *new* prefix would
look uncached everywhere and be spread over the pool, each worker computing the
same prefix. So at placement the router records the prompt's full blocks as
pending on the chosen worker; lookups count them as held there (weight 1: by the
time a second request's prefill runs on that worker, vLLM serves those blocks
from its prefix cache, so its uncached tokens really are the suffix only).

An entry ends when the worker's KV events confirm the block (stored: it becomes a
normal index entry), when the last prefill that recorded it fails, when the
worker drops it (removed / cleared / resync / the worker leaves), or after
``ttl_s``: a lost event must not pin a prefix to a worker forever. At most
``max_entries`` entries live at once (the oldest go first), so memory stays
bounded whatever the offered load.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

_NO_HOLDERS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class PendingConfig:
    # Longer than any prefill plus its KV-event delay; short enough that a lost
    # event only misroutes for a while.
    ttl_s: float = 30.0
    # (worker, block) entries: a 4k-token prompt is 32 blocks of 128 tokens, so
    # this covers ~2000 distinct prompts in flight.
    max_entries: int = 65_536

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, not {self.ttl_s}")
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, not {self.max_entries}")


class _Entry:
    """One (worker, block): its deadline, and how many in-flight prefills recorded it."""

    __slots__ = ("deadline", "num_requests")

    def __init__(self, deadline: float) -> None:
        self.deadline = deadline
        self.num_requests = 1


class PendingBlocks:
    """(worker, block) entries in deadline order (every entry lives ``ttl_s``, so the
    order of insertion or refresh is the order of expiry: expiring is popping
    from the front, amortised O(1) per entry)."""

    def __init__(self, config: PendingConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or PendingConfig()
        self._clock = clock
        self._entries: OrderedDict[tuple[str, int], _Entry] = OrderedDict()
        self._holders: dict[int, set[str]] = {}
        self._of_worker: dict[str, set[int]] = {}
        self.num_expired = 0
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._entries)

    # -- hooks ----------------------------------------------------------------
    def add(self, worker_id: str, hashes: Iterable[int]) -> None:
        """A prefill computing ``hashes`` was placed on the worker."""
        deadline = self._clock() + self.config.ttl_s
        for h in hashes:
            key = (worker_id, h)
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = _Entry(deadline)
                self._holders.setdefault(h, set()).add(worker_id)
                self._of_worker.setdefault(worker_id, set()).add(h)
            else:
                entry.num_requests += 1
                entry.deadline = deadline
                self._entries.move_to_end(key)
        while len(self._entries) > self.config.max_entries:
            self._pop_oldest()
            self.num_evicted += 1

    def release(self, worker_id: str, hashes: Iterable[int]) -> None:
        """A prefill that recorded ``hashes`` failed: they stay pending only while
        another in-flight prefill recorded them too."""
        for h in hashes:
            entry = self._entries.get((worker_id, h))
            if entry is not None:
                entry.num_requests -= 1
                if entry.num_requests <= 0:
                    self._drop(worker_id, h)

    def discard(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The worker reported these blocks (stored or removed): no longer pending."""
        if worker_id in self._of_worker:
            for h in hashes:
                if (worker_id, h) in self._entries:
                    self._drop(worker_id, h)

    def drop_worker(self, worker_id: str) -> None:
        for h in list(self._of_worker.get(worker_id, ())):
            self._drop(worker_id, h)

    def expire(self) -> None:
        """Drop the entries past their deadline (call before reading)."""
        now = self._clock()
        while self._entries:
            entry = next(iter(self._entries.values()))
            if entry.deadline > now:
                return
            self._pop_oldest()
            self.num_expired += 1

    # -- reads ----------------------------------------------------------------
    def holders(self, h: int) -> set[str] | frozenset[str]:
        """Workers with ``h`` pending (as of the last ``expire``)."""
        return self._holders.get(h, _NO_HOLDERS)

    def blocks_of(self, worker_id: str) -> set[int]:
        return set(self._of_worker.get(worker_id, ()))

    def _pop_oldest(self) -> None:
        (worker_id, h), _ = self._entries.popitem(last=False)
        self._unlink(worker_id, h)

    def _drop(self, worker_id: str, h: int) -> None:
        del self._entries[(worker_id, h)]
        self._unlink(worker_id, h)

    def _unlink(self, worker_id: str, h: int) -> None:
        holders = self._holders[h]
        holders.discard(worker_id)
        if not holders:
            del self._holders[h]
        mine = self._of_worker[worker_id]
        mine.discard(h)
        if not mine:
            del self._of_worker[worker_id]
