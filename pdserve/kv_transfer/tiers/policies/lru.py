"""Least recently used, and LRU whose blocks expire a fixed time after they were saved."""

from __future__ import annotations

from collections import OrderedDict

from pdserve.kv_transfer.tiers.policy import Evictable, Key


class LruPolicy:
    """Evicts the least recently used evictable held key; admits every key."""

    def __init__(self) -> None:
        self._order: OrderedDict[Key, None] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._order)

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def record_access(self, key: Key, now: float) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def admit(self, key: Key, now: float, tenant: str | None) -> bool:
        return True

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None:
        return next((k for k in self._order if evictable(k)), None)

    def on_remove(self, key: Key) -> None:
        self._order.pop(key, None)

    def expired(self, now: float) -> list[Key]:
        return []


class TtlPolicy(LruPolicy):
    """LRU whose keys expire ``ttl_s`` seconds after they were saved (an access does not
    extend them: a block's lifetime is its bytes', as a store's TTL)."""

    def __init__(self, ttl_s: float) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl must be > 0 seconds, got {ttl_s}")
        super().__init__()
        self.ttl_s = ttl_s
        self._born: OrderedDict[Key, float] = OrderedDict()  # oldest first

    def on_insert(self, key: Key, now: float, tenant: str | None) -> None:
        super().on_insert(key, now, tenant)
        self._born[key] = now
        self._born.move_to_end(key)

    def on_remove(self, key: Key) -> None:
        super().on_remove(key)
        self._born.pop(key, None)

    def expired(self, now: float) -> list[Key]:
        out = []
        for key, born in self._born.items():
            if born + self.ttl_s > now:
                break
            out.append(key)
        return out
