"""A simulated engine for router-scale tests and benchmarks (never instead of vLLM):
``SimEngine`` implements the ``Engine`` contract, so the real ``EngineHost`` hosts it
with the real role policies (``pdserve.roles``), as it hosts vLLM's.

It models what placement cares about: a prefix cache of ``num_blocks`` blocks with LRU
eviction (``cache.py``: named by pdserve's chained hashes, its KV events the same
shape as a vLLM worker's), prompt time proportional to the uncached prompt tokens (one
prompt at a time, like one engine's compute), and decode time per token. A request whose
KV a prefill handed over (``do_remote_prefill``) loads it in no modelled time; one that
keeps its KV for a decode (``do_remote_decode``) ends with a KV handle, as vLLM's
connector's, though no block ever moves. Its weights are a version name: staging a
checkpoint folder takes a modelled time, and the made-up tokens depend on the version
served (the model's own, "default", makes the tokens it always made), so a test can tell
which weights produced a text.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.handle import KVHandle
from pdserve.core.types import Role, SamplingSpec, WeightsStaged
from pdserve.core.weight_calls import WeightCall, version_set_by
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.worker.engine import EngineConfig, EngineCounters, EngineParams, EngineStep
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.lora.adapters import LoadedLora
from pdserve.worker.sim.cache import SimPrefixCache, StepClock


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

    @property
    def engine_config(self) -> EngineConfig:
        """The host's config: model "sim", no KV endpoint (``kv_port`` 0), no KV-event
        endpoints (the engine mirrors its cache in-process), and vLLM's weight-transfer
        calls taken, as a CPU worker started with ``--weight-transfer-backend gloo``
        takes them (no tensor moves in a simulator)."""
        return EngineConfig(
            model_path="sim", served_model_name="sim", role=self.role,
            connector=ConnectorConfig(engine_id=self.worker_id), dtype="sim",
            max_model_len=self.max_model_len, weight_version=self.weight_version,
            weight_transfer_backend="gloo")


@dataclass(frozen=True)
class SimPrefill:
    num_cached_tokens: int
    queue_ns: int
    compute_ns: int


# A KV handle's lease, as a vLLM prefill's default (``--kv-lease-s``).
_LEASE_NS = int(30e9)


class SimEngine:
    """``counters``: the host's (``EngineHost`` hands its own to the engine factory)."""

    def __init__(self, config: SimConfig, counters: EngineCounters | None = None) -> None:
        self.config = config
        self.counters = counters if counters is not None else EngineCounters()
        self.cache = SimPrefixCache(config.block_size, config.num_blocks, self.counters)
        self._compute = asyncio.Lock()
        self._step = StepClock(config.decode_s_per_token) if config.lockstep else None
        self._version = config.weight_version
        self._weights_seed = _weights_seed(config.weight_version)
        self._staged: str | None = None
        self._running: set[str] = set()  # requests whose generator has started
        self._aborted: set[str] = set()  # running, told to stop: ends at its next token

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def dtype(self) -> str:
        return "sim"

    @property
    def num_kv_blocks(self) -> int:
        return self.config.num_blocks

    @property
    def mirror(self) -> KvCacheMirror:
        return self.cache.mirror

    def token(self, prompt: Sequence[int], index: int) -> int:
        """Output token ``index`` of ``prompt``'s answer: a function of the prompt and the
        weights alone, as a greedy engine's is, whichever worker made the ones before."""
        return 10 + (sum(prompt) + self._weights_seed + index) % 1000

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSpec, params: EngineParams
                       ) -> AsyncGenerator[EngineStep, None]:
        """The prompt computed (or its KV loaded), then ``params.max_tokens`` tokens, one
        step each; an aborted request ends at its next token, as vLLM ends one."""
        prompt, kv = tuple(prompt_token_ids), params.kv_transfer_params or {}
        counters, started = self.counters, time.perf_counter_ns()
        running, compute_ns = False, 0
        self._running.add(request_id)
        try:
            if kv.get("do_remote_prefill"):
                # Its prompt ends with the prefill's first token: the answer goes on from
                # its second token, the text the same as had the prompt been computed here.
                counters.num_running_reqs += 1
                running = True
                self.cache.hold(prompt, sampling.cache_salt)
                answer, first, run = prompt[:-1], 1, SimPrefill(0, 0, 0)
            else:
                run = await self._prefill_timed(prompt, sampling.cache_salt, hold=True)
                running = True
                answer, first = prompt, 0
            last = first + params.max_tokens - 1
            for i in range(first, last + 1):
                if i > 0:  # the first token comes with the prompt's compute
                    await self._next_step()
                if request_id in self._aborted:
                    yield EngineStep((), finished=True, finish_reason="abort")
                    return
                # Loaded KV: its compute is the wait for the first token.
                compute_ns = compute_ns or run.compute_ns or time.perf_counter_ns() - started
                if i < last:
                    yield EngineStep((self.token(answer, i),),
                                     num_cached_tokens=run.num_cached_tokens)
                    continue
                yield EngineStep(
                    (self.token(answer, i),), finished=True, finish_reason="length",
                    kv_transfer_params=self._handle(request_id, len(prompt))
                    if kv.get("do_remote_decode") else None,
                    num_cached_tokens=run.num_cached_tokens, queue_ns=run.queue_ns,
                    compute_ns=compute_ns)
        finally:
            if running:
                counters.num_running_reqs -= 1
            self._running.discard(request_id)
            self._aborted.discard(request_id)

    def _handle(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        """The KV handle a decode continues from: no blocks, no endpoint (nothing moves)."""
        return KVHandle(engine_id=self.config.worker_id, remote_request_id=request_id,
                        block_ids=(), num_tokens=num_tokens, transport="sim", host="", port=0,
                        transfer_id=request_id,
                        lease_deadline_unix_ns=time.time_ns() + _LEASE_NS).to_params()

    async def _next_step(self) -> None:
        if self._step is not None:
            await self._step.next()
        else:
            await asyncio.sleep(self.config.decode_s_per_token)

    async def prefill(self, prompt: Sequence[int], cache_salt: str | None = None) -> int:
        """Compute ``prompt`` alone (modelled time); the prompt tokens served from cache
        (only blocks computed under the same ``cache_salt``)."""
        return (await self._prefill_timed(prompt, cache_salt)).num_cached_tokens

    async def _prefill_timed(self, prompt: Sequence[int], cache_salt: str | None,
                             hold: bool = False) -> SimPrefill:
        """Compute the prompt once the compute is free, with its time in the queue and
        computing; ``hold``: it counts as running from then on (the caller ends it)."""
        c, cfg = self.counters, self.config
        queued = time.perf_counter_ns()
        c.num_waiting_reqs += 1
        try:
            await self._compute.acquire()
        finally:
            c.num_waiting_reqs -= 1
        scheduled = time.perf_counter_ns()
        c.num_running_reqs += 1
        try:
            hashes, hit = self.cache.lookup(prompt, cache_salt)
            cached = min(hit * cfg.block_size, len(prompt) - 1)  # vLLM recomputes >= 1
            await asyncio.sleep(cfg.step_overhead_s
                                + (len(prompt) - cached) * cfg.prefill_s_per_token)
            self.cache.store(hashes[hit:])
            c.prompt_tokens_computed += len(prompt) - cached
            c.prompt_tokens_local_cache_hit += cached
        except BaseException:
            c.num_running_reqs -= 1
            raise
        finally:
            self._compute.release()
        if not hold:
            c.num_running_reqs -= 1
        return SimPrefill(cached, scheduled - queued, time.perf_counter_ns() - scheduled)

    async def abort(self, request_id: str) -> None:
        """Ends a running request at its next token; one whose generator never started
        leaves nothing behind (a later request of the same id is not aborted)."""
        if request_id in self._running:
            self._aborted.add(request_id)

    def shutdown(self) -> None:
        return None

    def mirror_kv_events(self, loop: asyncio.AbstractEventLoop) -> KvCacheMirror | None:
        return self.cache.mirror

    def kv_status(self) -> dict[str, Any]:
        """Its cost model as an engine's measured step fit (streams decode side by side: a
        sequence adds nothing to a step); no lease held, no transfer (nothing moves)."""
        cfg = self.config
        return {"step_base_us": round(cfg.decode_s_per_token * 1e6), "step_per_seq_us": 0,
                "step_per_token_ns": round(cfg.prefill_s_per_token * 1e9),
                "step_decode_samples": 1, "step_prefill_samples": 1}

    # ---- LoRA adapters: the made-up tokens do not depend on them ----

    async def add_lora(self, lora: LoadedLora) -> None:
        return None

    async def remove_lora(self, lora_id: int) -> None:
        return None

    # ---- weights: a version name ----

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        """Read a checkpoint folder (modelled time; ``num_bytes``: its files' sizes, no
        tensors read); ``ValueError`` when it is not a folder."""
        folder = Path(model_path)
        if not folder.is_dir():
            raise ValueError(f"{model_path}: not a checkpoint folder")
        started = time.monotonic_ns()
        await asyncio.sleep(self.config.stage_weights_s)
        num_bytes = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        self._staged = version
        return WeightsStaged(num_bytes=num_bytes, stage_ns=time.monotonic_ns() - started)

    async def commit_weights(self, version: str) -> None:
        self.load_weights(version)

    async def discard_weights(self) -> bool:
        discarded, self._staged = self._staged is not None, None
        return discarded

    async def weight_call(self, call: WeightCall) -> str:
        """Only the calls naming a version change it (no tensors move in a simulator)."""
        version = version_set_by(call)
        if version is not None and version != self._version:
            self.load_weights(version)
        return self._version

    def load_weights(self, version: str) -> None:
        """Serve ``version``'s weights: its own tokens, and an empty prefix cache, as
        vLLM's is reset at an update."""
        self._version, self._staged = version, None
        self._weights_seed = _weights_seed(version)
        self.cache.clear()


def _weights_seed(version: str) -> int:
    """What ``version`` adds to the made-up tokens (0 for the model's own weights)."""
    if version == DEFAULT_WEIGHT_VERSION:
        return 0
    return int.from_bytes(hashlib.blake2b(version.encode(), digest_size=4).digest(), "big")
