"""The router's prefix index: which prefill worker holds which KV blocks.

Blocks are pdserve chained hashes (``pdserve.block_hash``): a hash names a
block *and* everything before it, so a worker's match for a prompt is the
number of leading prompt blocks it holds. Fed by each worker's KV events
(``router/kv_feed.py``); reads (``match``) never change it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._blocks: dict[str, set[int]] = {}
        self._block_size: dict[str, int] = {}

    # -- hooks (the only way state changes) ---------------------------------
    def replace(self, worker_id: str, block_size: int, hashes: Iterable[int]) -> None:
        """Resync: the worker's whole set, from its snapshot."""
        self.remove_worker(worker_id)
        self._block_size[worker_id] = block_size
        self.apply(worker_id, False, hashes, ())

    def apply(self, worker_id: str, cleared: bool, stored: Iterable[int],
              removed: Iterable[int]) -> None:
        """One batch of the worker's KV events (``cleared`` first)."""
        if cleared:
            self._drop_blocks(worker_id)
        mine = self._blocks.setdefault(worker_id, set())
        for h in stored:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(worker_id)
        for h in removed:
            if h in mine:
                mine.discard(h)
                self._discard_holder(h, worker_id)

    def remove_worker(self, worker_id: str) -> None:
        """The worker left (or its event stream broke): forget all it held."""
        self._drop_blocks(worker_id)
        self._blocks.pop(worker_id, None)
        self._block_size.pop(worker_id, None)

    # -- reads ----------------------------------------------------------------
    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` each worker holds (workers with none omitted)."""
        matched: dict[str, int] = {}
        alive: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            alive = set(holders) if alive is None else alive & holders
            if not alive:
                break
            for w in alive:
                matched[w] = i + 1
        return matched

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
