"""The tiers' default policy: W-TinyLFU whose window is set by two shadow caches.

Neither LRU nor W-TinyLFU wins everywhere (Mooncake's traces: W-TinyLFU is twice
LRU's hit ratio on a chat trace at small sizes, and behind LRU on a synthetic one at
every size). So two shadows of the tier's size, keys only, see every reference: one
LRU, one W-TinyLFU (1 % window). Each counts its hits, decayed so the last few
tier-fulls of references count most. The real tier is a W-TinyLFU whose window is the
whole tier (which is LRU) while the LRU shadow leads, and 1 % while the W-TinyLFU
shadow leads; the change is gradual, as the tier's own evictions move blocks between
the window and main. Costs: about three times LRU's work per reference, and two
key sets of the tier's size.
"""

from __future__ import annotations

from collections import OrderedDict

from pdserve.kv_transfer.tiers.policies.tinylfu import TinyLfuPolicy
from pdserve.kv_transfer.tiers.policy import Key


def _always(key: Key) -> bool:
    return True


class _Shadows:
    def __init__(self, capacity: int, window: float, decay_refs: int) -> None:
        self.capacity = capacity
        self.lru: OrderedDict[Key, None] = OrderedDict()
        self.tlfu = TinyLfuPolicy(capacity, window)
        self._decay = 1.0 - 1.0 / decay_refs
        self.lru_score = 0.0
        self.tlfu_score = 0.0

    def reference(self, key: Key, now: float) -> None:
        self.lru_score *= self._decay
        self.tlfu_score *= self._decay
        if key in self.lru:
            self.lru.move_to_end(key)
            self.lru_score += 1
        else:
            if len(self.lru) >= self.capacity:
                self.lru.popitem(last=False)
            self.lru[key] = None
        tlfu = self.tlfu
        if tlfu.holds(key):
            tlfu.record_access(key, now)
            self.tlfu_score += 1
            return
        tlfu.admit(key, now, None)
        if len(tlfu) >= self.capacity:
            victim = tlfu.victim(now, _always, None)
            if victim is not None:
                tlfu.on_remove(victim)
        tlfu.on_insert(key, now, None)


class DefaultPolicy(TinyLfuPolicy):
    def __init__(self, capacity: int, window: float = 0.01, decay_tiers: float = 2.0,
                 margin: float = 0.01) -> None:
        super().__init__(capacity, 1.0)
        self._small = max(round(capacity * window), 0)
        self._margin = margin
        self._shadows = _Shadows(capacity, window, max(round(capacity * decay_tiers), 1000))

    @property
    def leader(self) -> str:
        """The shadow the tier follows now: ``lru`` or ``wtinylfu``."""
        return "lru" if self.window_slots == self.capacity else "wtinylfu"

    def record_access(self, key: Key, now: float) -> None:
        super().record_access(key, now)
        self._reference(key, now)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        self._reference(key, now)
        return super().admit(key, now, tenant)

    def _reference(self, key: Key, now: float) -> None:
        shadows = self._shadows
        shadows.reference(key, now)
        lru, tlfu = shadows.lru_score, shadows.tlfu_score
        if self.window_slots == self.capacity and tlfu > lru * (1 + self._margin):
            self.window_slots = self._small
            self._rebalance()
        elif self.window_slots != self.capacity and lru > tlfu * (1 + self._margin):
            self.window_slots = self.capacity
