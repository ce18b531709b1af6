"""The tiers' default policy: LRU or S3-FIFO, whichever a shadow of each has hit more
with lately.

Neither wins everywhere. On Mooncake's conversation trace most prefixes come back
hundreds of requests later, far past what an LRU of a few thousand blocks remembers:
S3-FIFO with a long ghost (``s3fifo.py``) keeps the blocks seen twice and is 1.7–1.9×
LRU there at 1,000–3,000 blocks, but behind LRU once the tier holds most of the
working set (30,000 blocks) and level with it on the synthetic trace. So two shadows
of the tier's size, keys only, see every reference (an access or a save): an LRU and
an S3-FIFO. Each counts its hits, decayed so that the last ``decay_tiers`` tier-fulls
of references count most, and the tier evicts what the leading shadow's policy would:
the tier keeps both orders over its own held keys, so a switch takes effect at the
next eviction. The leader changes only when the other shadow is ahead by ``margin``
(1 %), so it does not flap on noise.

A tier of more than ``SHADOW_KEYS`` (2,500) slots is shadowed by sampling (SHARDS,
Waldspurger et al.): its shadows are ``rate`` times smaller and see only the keys of one
hash bucket in ``rate``, so their cost and memory stay bounded however large the tier.

Costs per reference: O(1), two orders and (for a sampled key) two shadows, a few times
LRU's (``pdserve bench cache-sim`` reports ns per block reference: docs/benchmarks.md);
memory: the tier's keys twice plus S3-FIFO's ghost (4× the tier's keys), and shadows of
at most 2,500 slots (and their ghost).
"""

from __future__ import annotations

from pdserve.kv_transfer.tiers.policies.lru import LruPolicy
from pdserve.kv_transfer.tiers.policies.s3fifo import S3FifoPolicy
from pdserve.kv_transfer.tiers.policy import Evictable, Key, TierPolicy

LEADERS = ("lru", "s3fifo")
SHADOW_KEYS = 2500  # a larger tier's shadows see a sample of its keys, of this many slots
_GOLDEN = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


def _bucket(key: Key) -> int:
    """A key's sample bucket, the same every run (not Python's salted ``hash``)."""
    return ((int.from_bytes(key[:8], "little") * _GOLDEN) & _MASK64) >> 40


def _always(key: Key) -> bool:
    return True


class _Shadow:
    """A tier of ``capacity`` keys (no bytes) under ``policy``, counting decayed hits."""

    def __init__(self, capacity: int, policy: LruPolicy | S3FifoPolicy) -> None:
        self.capacity = capacity
        self.policy = policy
        self.held: set[Key] = set()
        self.score = 0.0

    def reference(self, key: Key, now: float) -> None:
        policy = self.policy
        if key in self.held:
            policy.record_access(key, now)
            self.score += 1
            return
        if len(self.held) >= self.capacity:
            victim = policy.victim(now, _always, None)
            if victim is not None:
                policy.on_remove(victim)
                self.held.discard(victim)
        self.held.add(key)
        policy.on_insert(key, now, None)


class DefaultPolicy:
    def __init__(self, capacity: int, decay_tiers: float = 4.0, margin: float = 0.01) -> None:
        if capacity <= 0 or decay_tiers <= 0 or margin < 0:
            raise ValueError("default needs capacity > 0, decay_tiers > 0, margin >= 0")
        self.capacity = capacity
        self._orders: tuple[TierPolicy, TierPolicy] = (LruPolicy(), S3FifoPolicy(capacity))
        # Spatial sampling (SHARDS): a tier of more than SHADOW_KEYS slots is shadowed by
        # tiers 1/rate its size that see the keys of one bucket in ``rate``.
        self._rate = max(capacity // SHADOW_KEYS, 1)
        size = max(capacity // self._rate, 1)
        self._shadows = (_Shadow(size, LruPolicy()), _Shadow(size, S3FifoPolicy(size)))
        self._decay = 1.0 - 1.0 / max(size * decay_tiers, 1000.0)
        self._margin = margin
        self._lead = 0
        self.num_switches = 0

    @property
    def leader(self) -> str:
        """The policy the tier evicts by now: ``lru`` or ``s3fifo``."""
        return LEADERS[self._lead]

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        for order in self._orders:
            order.on_insert(key, now, tenant)

    def record_access(self, key: Key, now: float) -> None:
        for order in self._orders:
            order.record_access(key, now)
        self._reference(key, now)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        self._reference(key, now)
        return True

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        return self._orders[self._lead].victim(now, evictable, tenant)

    def on_remove(self, key: Key) -> None:
        for order in self._orders:
            order.on_remove(key)

    def expired(self, now: float) -> list[Key]:
        return []

    def _reference(self, key: Key, now: float) -> None:
        if self._rate > 1 and _bucket(key) % self._rate:
            return
        lru, s3 = self._shadows
        lru.score *= self._decay
        s3.score *= self._decay
        lru.reference(key, now)
        s3.reference(key, now)
        ahead = s3.score > lru.score * (1 + self._margin)
        behind = lru.score > s3.score * (1 + self._margin)
        if (self._lead == 0 and ahead) or (self._lead == 1 and behind):
            self._lead = 1 - self._lead
            self.num_switches += 1
