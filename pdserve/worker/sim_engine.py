"""A simulated engine for router-scale tests and benchmarks (never instead of vLLM).

It models what placement cares about: a prefix cache of ``num_blocks`` blocks
with LRU eviction (named by pdserve's chained hashes, so its KV events are the
same shape as a vLLM worker's), prefill time proportional to the uncached
prompt tokens (one prefill at a time, like one engine's compute), and decode time
per token. Its cache changes go through a ``KvCacheMirror``, i.e. through the
same relay a vLLM worker uses. Its weights are a version name: staging a checkpoint
folder takes a modelled time, and the made-up tokens depend on the version served
(the model's own, "default", makes the tokens it always made), so a test can tell
which weights produced a text.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION, chain_hashes, salt_root
from pdserve.core.types import Role, WeightsStaged
from pdserve.worker.kv_mirror import KvCacheMirror


@dataclass(frozen=True)
class SimConfig:
    role: Role
    worker_id: str
    block_size: int = 16
    num_blocks: int = 1024
    prefill_s_per_token: float = 20e-6
    step_overhead_s: float = 2e-3
    decode_s_per_token: float = 2e-3
    max_model_len: int = 4096
    # True: every running decode gets its next token on one shared step clock, as a real
    # engine's batch does (one step, a token for each); False: each on its own timer.
    lockstep: bool = False
    # The version of the weights it starts with, and how long staging a checkpoint takes.
    weight_version: str = DEFAULT_WEIGHT_VERSION
    stage_weights_s: float = 0.05

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {self.role!r}")
        if self.block_size < 1 or self.num_blocks < 1:
            raise ValueError("block_size and num_blocks must be >= 1")
        if min(self.prefill_s_per_token, self.step_overhead_s, self.decode_s_per_token,
               self.stage_weights_s) < 0:
            raise ValueError("modelled times must be >= 0")
        if not self.weight_version.strip():
            raise ValueError("weight_version must not be empty")


@dataclass(frozen=True)
class SimPrefill:
    num_cached_tokens: int
    queue_ns: int
    compute_ns: int


@dataclass
class SimCounters:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_local_cache_hit: int = 0


class SimEngine:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.counters = SimCounters()
        self.mirror = KvCacheMirror(config.block_size)
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._compute = asyncio.Lock()
        self._step = _StepClock(config.decode_s_per_token) if config.lockstep else None
        self._weights_seed = _weights_seed(config.weight_version)

    @property
    def kv_cache_usage(self) -> float:
        return len(self._lru) / self.config.num_blocks

    def cached_prefix_blocks(self, hashes: Sequence[int]) -> int:
        n = 0
        for h in hashes:
            if h not in self._lru:
                break
            n += 1
        return n

    async def prefill(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        """Compute the prompt (modelled time); returns the prompt tokens served from cache
        (only blocks computed under the same ``cache_salt``)."""
        return (await self.prefill_timed(prompt, cache_salt)).num_cached_tokens

    async def prefill_timed(self, prompt: Sequence[int], cache_salt: str | None = None
                            ) -> SimPrefill:
        """``prefill``, with its time in the queue (waiting for the compute) and computing."""
        queued = time.perf_counter_ns()
        scheduled = await self._prefill_locked(prompt, queued, cache_salt)
        return SimPrefill(scheduled[0], scheduled[1] - queued,
                          time.perf_counter_ns() - scheduled[1])

    async def _prefill_locked(self, prompt: Sequence[int], queued: int,
                              cache_salt: str | None) -> tuple[int, int]:
        """(cached tokens, when the compute began)."""
        c, cfg = self.counters, self.config
        c.num_waiting_reqs += 1
        async with self._compute:
            scheduled = time.perf_counter_ns()
            c.num_waiting_reqs -= 1
            c.num_running_reqs += 1
            try:
                hashes = chain_hashes(prompt, cfg.block_size, salt_root(cache_salt))
                hit = self.cached_prefix_blocks(hashes)
                cached = min(hit * cfg.block_size, len(prompt) - 1)  # vLLM recomputes >= 1
                for h in hashes[:hit]:
                    self._lru.move_to_end(h)
                await asyncio.sleep(cfg.step_overhead_s
                                    + (len(prompt) - cached) * cfg.prefill_s_per_token)
                self._store(hashes[hit:])
                c.prompt_tokens_computed += len(prompt) - cached
                c.prompt_tokens_local_cache_hit += cached
                return cached, scheduled
            finally:
                c.num_running_reqs -= 1

    def token(self, prompt: Sequence[int], index: int) -> int:
        """Output token ``index`` of ``prompt``'s answer: a function of the prompt and the
        weights alone, as a greedy engine's is, whichever worker made the ones before."""
        return 10 + (sum(prompt) + self._weights_seed + index) % 1000

    async def decode(self, prompt: Sequence[int], max_tokens: int, first_index: int = 0
                     ) -> AsyncIterator[int]:
        """Output tokens ``first_index`` onwards of ``prompt``'s answer (``token``)."""
        self.counters.num_running_reqs += 1
        try:
            for i in range(first_index, first_index + max_tokens):
                if self._step is not None:
                    await self._step.next()
                else:
                    await asyncio.sleep(self.config.decode_s_per_token)
                yield self.token(prompt, i)
        finally:
            self.counters.num_running_reqs -= 1

    async def stage_weights(self, model_path: str) -> WeightsStaged:
        """Read a checkpoint folder (modelled time; ``num_bytes``: its files' sizes, no
        tensors read); ``ValueError`` when it is not a folder."""
        folder = Path(model_path)
        if not folder.is_dir():
            raise ValueError(f"{model_path}: not a checkpoint folder")
        started = time.monotonic_ns()
        await asyncio.sleep(self.config.stage_weights_s)
        num_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        return WeightsStaged(num_bytes=num_bytes, stage_ns=time.monotonic_ns() - started)

    def load_weights(self, version: str) -> None:
        """Serve ``version``'s weights: its own tokens, and an empty prefix cache, as
        vLLM's is reset at an update."""
        self._weights_seed = _weights_seed(version)
        self.clear()

    def hold(self, prompt: Sequence[int], cache_salt: str | None = None) -> None:
        """A decode's prompt is in this engine's cache now (loaded from a prefill, or
        computed here; its time is not modelled): its blocks are announced, as vLLM's
        KV events announce the blocks a decode loads."""
        self._store(chain_hashes(prompt, self.config.block_size, salt_root(cache_salt)))

    def _store(self, new: Sequence[int]) -> None:
        stored: list[int] = []
        for h in new:
            if h in self._lru:
                self._lru.move_to_end(h)
            else:
                self._lru[h] = None
                stored.append(h)
        evicted = [self._lru.popitem(last=False)[0]
                   for _ in range(max(0, len(self._lru) - self.config.num_blocks))]
        self.mirror.apply(False, stored, evicted)

    def clear(self) -> None:
        self._lru.clear()
        self.mirror.apply(True, (), ())


def _weights_seed(version: str) -> int:
    """What ``version`` adds to the made-up tokens (0 for the model's own weights)."""
    if version == DEFAULT_WEIGHT_VERSION:
        return 0
    return int.from_bytes(hashlib.blake2b(version.encode(), digest_size=4).digest(), "big")


class _StepClock:
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

