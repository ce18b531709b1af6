"""The host tier's index, on the connector's scheduler side: which content hashes
(vLLM's block hashes, the prefix cache's own names) the tier holds, in which slots.

The scheduler side decides everything: which slots a finished request's blocks are
written to (evicting the block the tier's policy chooses, ``tiers.policy``: LRU
unless told), which slots a new request loads from.
The worker side only copies. Ownership: a slot is *free*, *writing* (reserved for a
save, not matchable until the save is reported done: ``commit``), *held* (matchable),
or held and *pinned* by loads in flight (never evicted while pinned). Sizes are fixed
at start: nothing grows past ``num_slots``. The policy only orders and chooses among
held, unpinned blocks; the index keeps the slots and tells it of every change.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

from pdserve.kv_transfer.tiers.policies.lru import LruPolicy
from pdserve.kv_transfer.tiers.policy import Key, TierPolicy


class TierIndex:
    def __init__(self, num_slots: int, policy: TierPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self.policy: TierPolicy = policy if policy is not None else LruPolicy()
        self._clock = clock
        self._held: dict[bytes, int] = {}
        self._writing: dict[int, tuple[bytes, str | None]] = {}  # slot -> (hash, tenant)
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins: Counter[int] = Counter()
        self._orphans: set[int] = set()  # discarded while pinned: free once unpinned
        self._gone: list[bytes] = []  # held hashes evicted or discarded, not yet taken
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self._held)

    def adopt(self, slot: int, block_hash: bytes) -> None:
        """``slot`` already holds ``block_hash`` (a disk tier's file from before a
        restart): matchable, as the most recently used."""
        if slot in self._free and block_hash not in self._held:
            self._free.remove(slot)
            self._held[block_hash] = slot
            self.policy.on_insert(block_hash, self._clock(), None)

    def holds(self, block_hash: bytes) -> bool:
        """Whether ``block_hash`` is matchable (not an access)."""
        return block_hash in self._held

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (an access, for the policy), or None."""
        now = self._expire()
        slot = self._held.get(block_hash)
        if slot is not None:
            self.policy.record_access(block_hash, now)
        return slot

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the longest prefix of ``hashes`` the tier holds (each one an
        access, for the policy)."""
        now = self._expire()
        slots = []
        for h in hashes:
            slot = self._held.get(h)
            if slot is None:
                break
            self.policy.record_access(h, now)
            slots.append(slot)
        return slots

    def pin(self, slots: Sequence[int]) -> None:
        self._pins.update(slots)

    def unpin(self, slots: Sequence[int]) -> None:
        self._pins.subtract(slots)
        self._pins = +self._pins  # drop the zeros
        for slot in slots:
            if slot in self._orphans and self._pins[slot] <= 0:
                self._orphans.discard(slot)
                self._free.append(slot)

    def reserve(self, hashes: Sequence[bytes], tenant: str | None = None
                ) -> list[tuple[int, int]]:
        """Slots for the hashes the tier neither holds nor is writing and the policy
        admits: ``(index in hashes, slot)`` pairs, in order, stopping where no slot can
        be had (every held slot pinned, or the policy chose none). A held hash is an
        access. ``tenant``: the request's cache salt, for a policy with quotas."""
        now = self._expire()
        writing = {h for h, _ in self._writing.values()}
        out = []
        for i, h in enumerate(hashes):
            if h in self._held:
                self.policy.record_access(h, now)
                continue
            if h in writing or not self.policy.admit(h, now, tenant):
                continue
            slot = self._take_slot(now, tenant)
            if slot is None:
                break
            self._writing[slot] = (h, tenant)
            writing.add(h)
            out.append((i, slot))
        return out

    def commit(self, slots: Sequence[int]) -> None:
        """The saves into ``slots`` are done: their hashes become matchable."""
        now = self._clock()
        for slot in slots:
            written = self._writing.pop(slot, None)
            if written is not None:
                self._held[written[0]] = slot
                self.policy.on_insert(written[0], now, written[1])

    def discard(self, slots: Sequence[int]) -> None:
        """Forget ``slots`` (a save that failed, a load whose data was bad)."""
        for slot in slots:
            self._writing.pop(slot, None)
            for h, s in list(self._held.items()):
                if s == slot:
                    self._forget(h)
            if self._pins[slot] > 0:
                self._orphans.add(slot)
            elif slot not in self._free:
                self._free.append(slot)

    def drop_held(self) -> int:
        """Forget every matchable block (the weights changed: no block is valid any
        more); saves still writing land as usual. How many were dropped."""
        held = list(self._held.values())
        self.discard(held)
        return len(held)

    def take_gone(self) -> list[bytes]:
        """The hashes that stopped being matchable (evicted, discarded) since the last
        call: the tier's removal events."""
        gone, self._gone = self._gone, []
        return gone

    def _evictable(self, key: Key) -> bool:
        slot = self._held.get(key)
        return slot is not None and self._pins[slot] <= 0

    def _take_slot(self, now: float, tenant: str | None) -> int | None:
        if self._free:
            return self._free.pop()
        victim = self.policy.victim(now, self._evictable, tenant)
        if victim is None or not self._evictable(victim):
            return None
        slot = self._held[victim]
        self._forget(victim)
        self.num_evictions += 1
        return slot

    def _forget(self, h: bytes) -> None:
        del self._held[h]
        self._gone.append(h)
        self.policy.on_remove(h)

    def _expire(self) -> float:
        """Drop the blocks the policy says expired (a pinned one's slot is freed once
        unpinned); the clock's time."""
        now = self._clock()
        for key in self.policy.expired(now):
            slot = self._held.get(key)
            if slot is None:
                continue
            self._forget(key)
            if self._pins[slot] > 0:
                self._orphans.add(slot)
            else:
                self._free.append(slot)
        return now
