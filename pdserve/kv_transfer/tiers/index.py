"""The host tier's index, on the connector's scheduler side: which content hashes
(vLLM's block hashes, the prefix cache's own names) the tier holds, in which slots.

The scheduler side decides everything: which slots a finished request's blocks are
written to (evicting the least recently used), which slots a new request loads from.
The worker side only copies. Ownership: a slot is *free*, *writing* (reserved for a
save, not matchable until the save is reported done: ``commit``), *held* (matchable),
or held and *pinned* by loads in flight (never evicted while pinned). Sizes are fixed
at start: nothing grows past ``num_slots``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence


class TierIndex:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._held: OrderedDict[bytes, int] = OrderedDict()  # least recently used first
        self._writing: dict[int, bytes] = {}
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

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot holding ``block_hash`` (now the most recently used), or None."""
        slot = self._held.get(block_hash)
        if slot is not None:
            self._held.move_to_end(block_hash)
        return slot

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """The slots of the longest prefix of ``hashes`` the tier holds (each one becomes
        the most recently used)."""
        slots = []
        for h in hashes:
            slot = self._held.get(h)
            if slot is None:
                break
            self._held.move_to_end(h)
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

    def reserve(self, hashes: Sequence[bytes]) -> list[tuple[int, int]]:
        """Slots for the hashes the tier neither holds nor is writing: ``(index in
        hashes, slot)`` pairs, in order, stopping where no slot can be had (every held
        slot pinned). A held hash becomes the most recently used."""
        writing = set(self._writing.values())
        out = []
        for i, h in enumerate(hashes):
            if h in self._held:
                self._held.move_to_end(h)
                continue
            if h in writing:
                continue
            slot = self._take_slot()
            if slot is None:
                break
            self._writing[slot] = h
            writing.add(h)
            out.append((i, slot))
        return out

    def commit(self, slots: Sequence[int]) -> None:
        """The saves into ``slots`` are done: their hashes become matchable."""
        for slot in slots:
            h = self._writing.pop(slot, None)
            if h is not None:
                self._held[h] = slot

    def discard(self, slots: Sequence[int]) -> None:
        """Forget ``slots`` (a save that failed, a load whose data was bad)."""
        for slot in slots:
            self._writing.pop(slot, None)
            for h, s in list(self._held.items()):
                if s == slot:
                    del self._held[h]
                    self._gone.append(h)
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

    def _take_slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        for h, slot in self._held.items():
            if self._pins[slot] <= 0:
                del self._held[h]
                self._gone.append(h)
                self.num_evictions += 1
                return slot
        return None
