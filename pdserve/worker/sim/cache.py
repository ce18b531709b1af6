"""The simulated engine's parts (``engine.py``): its prefix cache, and the shared step
clock of its lockstep decodes.

The cache holds ``num_blocks`` blocks named by pdserve's chained hashes, evicts the least
recently used, and announces every change through a ``KvCacheMirror``: the same relay a
vLLM worker's KV events reach the routers through."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.core.block_hash import chain_hashes, salt_root
from pdserve.worker.engine import EngineCounters
from pdserve.worker.kv.mirror import KvCacheMirror


class SimPrefixCache:
    """``counters``: the engine's; its ``kv_cache_usage`` follows the cache."""

    def __init__(self, block_size: int, num_blocks: int, counters: EngineCounters) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.mirror = KvCacheMirror(block_size)
        self._counters = counters
        self._lru: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._lru)

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    def lookup(self, prompt: Sequence[int], cache_salt: str | None) -> tuple[list[int], int]:
        """``prompt``'s block hashes under ``cache_salt``, and how many of the first are
        cached (used now: the most recent)."""
        hashes = chain_hashes(prompt, self.block_size, salt_root(cache_salt))
        hit = self.cached_prefix_blocks(hashes)
        for h in hashes[:hit]:
            self._lru.move_to_end(h)
        return hashes, hit

    def hold(self, prompt: Sequence[int], cache_salt: str | None = None) -> None:
        """A decode's prompt is in the cache now (loaded from a prefill; its time is not
        modelled): its blocks are announced, as vLLM's KV events announce the blocks a
        decode loads."""
        self.store(chain_hashes(prompt, self.block_size, salt_root(cache_salt)))

    def store(self, new: Sequence[int]) -> None:
        stored: list[int] = []
        for h in new:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                stored.append(h)
        evicted = [self._lru.popitem(last=False)[0]
                   for _ in range(max(0, len(self._lru) - self.num_blocks))]
        self.mirror.apply(False, stored, evicted)
        self._counters.kv_cache_usage = len(self._lru) / self.num_blocks

    def clear(self) -> None:
        self._lru.clear()
        self.mirror.apply(True, (), ())
        self._counters.kv_cache_usage = 0.0


class StepClock:
    """The lockstep decode's engine step: ``next`` returns at the end of the step that is
    running (every waiter of one step together). It ticks only while someone waits."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._step: asyncio.Future[None] | None = None

    async def next(self) -> None:
        if self._step is None:
            loop = asyncio.get_running_loop()
            self._step = loop.create_future()
            loop.call_later(self._period_s, self._tick)
        await asyncio.shield(self._step)

    def _tick(self) -> None:
        step, self._step = self._step, None
        if step is not None and not step.done():
            step.set_result(None)
