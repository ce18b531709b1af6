"""The router's prefix index: which prefill worker holds which KV blocks.

Blocks are pdserve chained hashes (``pdserve.core.block_hash``): a hash names a
block *and* everything before it, so a worker's match for a prompt is the
number of leading prompt blocks it holds. Fed by each worker's KV events
(``kv_feed.py``) and, for prefills in flight, by the placement itself
(pending blocks, ``prefix/pending.py``); reads change it only by expiring
pending blocks past their deadline and (``forget_block``) blocks announced to the
cluster KV store past their lifetime there (``prefix/store_match.py``). Each held
block keeps when it was last announced (``stored_at``), for the latter.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pdserve.router.dispatch.prefix.pending import PendingBlocks, PendingConfig

_NO_HOLDERS: set[str] = set()
_FORGOTTEN_CAP = 1 << 16


@dataclass(frozen=True)
class PrefixMatch:
    """Per worker id, the leading prompt blocks it holds or is computing
    (``num_blocks``), and how many of those are only pending (``num_pending``)."""

    num_blocks: dict[str, int] = field(default_factory=dict)
    num_pending: dict[str, int] = field(default_factory=dict)


class PrefixIndex:
    def __init__(self, pending: PendingConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}
        self._stored_at: dict[int, float] = {}  # per held block, its last stored event
        # Blocks forgotten past their store lifetime, the latest ``_FORGOTTEN_CAP``: a
        # snapshot does not bring them back, a stored event (published again) does.
        self._forgotten: OrderedDict[int, None] = OrderedDict()
        self._clock = clock
        self.pending = PendingBlocks(pending, clock)

    # -- hooks (the only way state changes) ---------------------------------
    def replace(self, worker_id: str, block_size: int, hashes: Iterable[int]) -> None:
        """Resync: the worker's whole set, from its snapshot. Blocks already held (by it
        or another worker) keep when they were announced: a snapshot re-announces, the
        store's lifetime of a block does not restart, nor does a forgotten one return."""
        hashes = [h for h in hashes if h not in self._forgotten]
        known = {h: t for h in hashes if (t := self._stored_at.get(h)) is not None}
        self.remove_worker(worker_id)
        self._block_size[worker_id] = block_size
        self.apply(worker_id, False, hashes, ())
        self._stored_at.update(known)

    def apply(self, worker_id: str, cleared: bool, stored: Iterable[int],
              removed: Iterable[int]) -> None:
        """One batch of the worker's KV events (``cleared`` first). Stored blocks
        confirm pending ones; removed or cleared ones end them."""
        if cleared:
            self._drop_blocks(worker_id)
            self.pending.drop_worker(worker_id)
        mine = self._blocks.setdefault(worker_id, set())
        stored, removed = list(stored), list(removed)
        now = self._clock()
        if self._forgotten:
            for h in stored:
                self._forgotten.pop(h, None)
        for h in stored:
            self._stored_at[h] = now
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
        for h in removed:
            if h in mine:
                mine.discard(h)
                self._discard_holder(h, worker_id)
        self.pending.discard(worker_id, stored)
        self.pending.discard(worker_id, removed)

    def remove_worker(self, worker_id: str) -> None:
        """The worker left (or its event stream broke, or it resyncs): forget all it
        held, and what it was computing (no event will confirm it)."""
        self._drop_blocks(worker_id)
        self._blocks.pop(worker_id, None)
        self._block_size.pop(worker_id, None)
        self.pending.drop_worker(worker_id)

    def add_pending(self, worker_id: str, hashes: Sequence[int]) -> tuple[int, ...]:
        """A prefill of ``hashes`` was placed on the worker: the blocks it does not
        hold yet are pending there. Returns those (to release if it fails)."""
        mine = self._blocks.get(worker_id, set())
        new = tuple(h for h in hashes if h not in mine)
        self.pending.add(worker_id, new)
        return new

    def release_pending(self, worker_id: str, hashes: Iterable[int]) -> None:
        """The prefill that recorded ``hashes`` on the worker failed or was aborted."""
        self.pending.release(worker_id, hashes)

    # -- reads ----------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds or is computing (workers
        with none omitted)."""
        return self.match_blocks(hashes).num_blocks

    def match_blocks(self, hashes: Sequence[int]) -> PrefixMatch:
        """Leading blocks of ``hashes`` per worker, held or pending; O(blocks x
        matching workers), the decision's hot path."""
        self.pending.expire()
        matched: dict[str, int] = {}
        num_pending: dict[str, int] = {}
        alive: set[str] | None = None
        empty: set[str] = set()
        for i, h in enumerate(hashes):
            held = self._holders.get(h, empty)
            pending = self.pending.holders(h)
            holders = held | pending if pending else held
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
            for w in pending:  # usually none: only for prefixes placed just now
                if w in alive and w not in held:
                    num_pending[w] = num_pending.get(w, 0) + 1
        return PrefixMatch(matched, num_pending)

    def is_held(self, block_hash: int) -> bool:
        """Some worker holds the block (pending ones aside)."""
        return block_hash in self._holders

    def match_held(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds, pending ones aside (a KV
        tier's entries, which no placement makes pending); workers with none omitted.
        One set test per block: a worker's count is set once, when it drops out."""
        matched: dict[str, int] = {}
        alive: set[str] = set()
        n = 0
        for h in hashes:
            held = self._holders.get(h)
            if not held:
                break
            if not n:
                alive = set(held)
            elif not held >= alive:
                for w in alive - held:
                    matched[w] = n
                alive &= held
                if not alive:
                    break
            n += 1
        for w in alive:
            matched[w] = n
        return matched

    def holders(self, block_hash: int) -> set[str]:
        """The workers holding the block (pending ones aside); do not mutate."""
        return self._holders.get(block_hash, _NO_HOLDERS)

    def stored_at(self, block_hash: int) -> float | None:
        """When a worker last announced the held block (the index's clock); None: not held."""
        return self._stored_at.get(block_hash)

    def now(self) -> float:
        return self._clock()

    def forget_block(self, block_hash: int) -> None:
        """No worker holds the block any more (a store block past its lifetime); until a
        worker announces it again, a snapshot listing it does not restore it."""
        for w in self._holders.pop(block_hash, ()):
            self._blocks.get(w, set()).discard(block_hash)
        self._stored_at.pop(block_hash, None)
        self._forgotten[block_hash] = None
        self._forgotten.move_to_end(block_hash)
        if len(self._forgotten) > _FORGOTTEN_CAP:
            self._forgotten.popitem(last=False)

    def block_size(self, worker_id: str) -> int | None:
        return self._block_size.get(worker_id)

    def block_sizes(self) -> set[int]:
        return set(self._block_size.values())

    def workers(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, worker_id: str) -> set[int]:
        return set(self._blocks.get(worker_id, ()))

    @property
    def num_blocks(self) -> int:
        """Indexed (worker, block) entries."""
        return sum(len(b) for b in self._blocks.values())

    def _drop_blocks(self, worker_id: str) -> None:
        for h in self._blocks.get(worker_id, ()):
            self._discard_holder(h, worker_id)
        if worker_id in self._blocks:
            self._blocks[worker_id] = set()

    def _discard_holder(self, h: int, worker_id: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]
                self._stored_at.pop(h, None)
