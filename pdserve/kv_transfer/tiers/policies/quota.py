"""Per-tenant quotas around any policy: one tenant cannot evict another's whole
working set.

Each tenant holding blocks (a tenant is the request's cache salt; None is one tenant
too) is owed an equal share of the tier, ``capacity // tenants`` (the tenant asking
for a slot counted). A new block of tenant T may evict T's own blocks, or those of a
tenant holding more than its share, never a block of a tenant at or under its share;
among those the inner policy chooses. So a tenant that floods the tier takes free and
over-share slots, then recycles its own.
"""

from __future__ import annotations

from collections import Counter

from pdserve.kv_transfer.tiers.policy import Evictable, Key, TierPolicy


class QuotaPolicy:
    def __init__(self, inner: TierPolicy, capacity: int) -> None:
        self.inner = inner
        self.capacity = capacity
        self._owner: dict[Key, str | None] = {}
        self._held: Counter[str | None] = Counter()

    def held_by(self, tenant: str | None) -> int:
        return self._held[tenant]

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        self._owner[key] = tenant
        self._held[tenant] += 1
        self.inner.on_insert(key, now, tenant)

    def record_access(self, key: Key, now: float) -> None:
        self.inner.record_access(key, now)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        return self.inner.admit(key, now, tenant)

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        tenants = {t for t, n in self._held.items() if n > 0} | {tenant}
        share = self.capacity // len(tenants)
        over = {t for t in tenants if t == tenant or self._held[t] > share}

        def allowed(key: Key) -> bool:
            return self._owner.get(key) in over and evictable(key)

        return self.inner.victim(now, allowed, tenant)

    def on_remove(self, key: Key) -> None:
        if key in self._owner:
            tenant = self._owner.pop(key)
            self._held[tenant] -= 1
            if self._held[tenant] <= 0:
                del self._held[tenant]
        self.inner.on_remove(key)

    def expired(self, now: float) -> list[Key]:
        return self.inner.expired(now)
