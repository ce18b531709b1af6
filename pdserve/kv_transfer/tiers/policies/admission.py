"""Admission in front of any policy: which new blocks are worth a slot (a tier's) or a
write (the cluster KV store's, ``--kv-store-admission``).

- ``Doorkeeper``: TinyLFU's frequency doorkeeper alone. A key is admitted once it was
  wanted at least ``min_wants`` times (2) within the sketch's window: every ``admit``
  and every ``record_access`` (a hit) counts as a want, in a count-min sketch
  (``sketch.py``) that halves every count after 10× ``capacity`` wants, so old wants
  fade. A one-hit wonder is never admitted; a block asked for again is, at its second
  want. It keeps no keys, only the sketch's fixed counters: its memory is bounded
  whatever it sees. It holds nothing, so it never evicts anything (``victim``: None).
- ``Gated(gate, inner)``: ``inner``'s eviction with ``gate``'s admission: a key is
  admitted when both admit it (both are always asked, so each counts the want); hits
  reach both; everything else is ``inner``'s. The registry's ``doorkeeper:NAME`` is
  ``Gated(Doorkeeper, NAME)``; ``pdserve bench cache-sim --admission`` puts the store's
  admission policy in front of the replayed one the same way.

The cluster KV store is not a tier whose blocks a policy orders (the store's server
evicts, ``maxmemory``): its planner only calls ``admit`` (a finished request's block it
would publish) and ``record_access`` (a lookup found the block), never ``on_insert``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kv_transfer.tiers.policies.sketch import CountMinSketch
from pdserve.kv_transfer.tiers.policy import Evictable, Key, TierPolicy

MIN_WANTS = 2


def admitted_run(policy: TierPolicy, keys: Sequence[Key], now: float,
                 tenant: str | None) -> int:
    """How many of ``keys`` (a request's new blocks, in order) are written where only a
    prefix is useful (the cluster KV store): those before the first ``policy`` refuses.
    Every key is asked (each is a want), so a run wanted twice is admitted whole."""
    cut = len(keys)
    for i, key in enumerate(keys):
        if not policy.admit(key, now, tenant) and cut == len(keys):
            cut = i
    return cut


class Doorkeeper:
    def __init__(self, capacity: int, min_wants: int = MIN_WANTS) -> None:
        if capacity <= 0 or not 1 <= min_wants <= 15:
            raise ValueError("doorkeeper needs capacity > 0 and min_wants in [1, 15]")
        self.capacity = capacity
        self.min_wants = min_wants
        self.sketch = CountMinSketch(capacity)

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        pass

    def record_access(self, key: Key, now: float) -> None:
        self.sketch.add(key)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        self.sketch.add(key)
        return self.sketch.estimate(key) >= self.min_wants

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        return None

    def on_remove(self, key: Key) -> None:
        pass

    def expired(self, now: float) -> list[Key]:
        return []


class Gated:
    def __init__(self, gate: TierPolicy, inner: TierPolicy) -> None:
        self.gate = gate
        self.inner = inner

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        self.inner.on_insert(key, now, tenant)

    def record_access(self, key: Key, now: float) -> None:
        self.gate.record_access(key, now)
        self.inner.record_access(key, now)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        wanted = self.gate.admit(key, now, tenant)
        return self.inner.admit(key, now, tenant) and wanted

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        return self.inner.victim(now, evictable, tenant)

    def on_remove(self, key: Key) -> None:
        self.inner.on_remove(key)

    def expired(self, now: float) -> list[Key]:
        return self.inner.expired(now)
