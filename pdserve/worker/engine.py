"""The engine a worker hosts: its config, the ``Engine`` contract the host drives
(``VllmEngine`` wraps vLLM's ``AsyncLLM`` behind it, ``SimEngine`` simulates one; tests
use a fake), the
engine's own counters (prompt tokens by source, load, KV usage) for GetLoad, and
``build_engine``, which starts vLLM in-process with the pdserve KV connector."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, cast

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.dtype import resolve_dtype
from pdserve.core.lora import LoraConfig
from pdserve.core.types import Role, SamplingSpec, TokenLogprobs, WeightsStaged
from pdserve.core.weight_calls import WeightCall
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.worker.engine_tmp import engine_folder
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.lora.adapters import LoadedLora

# ``pdserve.worker.output_in_prompt:OutputInPromptPenalties``, named here so that the
# frontend does not import it (it imports torch); vLLM loads it in the engine.
OUTPUT_IN_PROMPT_PROCESSOR = "pdserve.worker.output_in_prompt:OutputInPromptPenalties"

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.metrics.stats import IterationStats, SchedulerStats

CONNECTOR_MODULE = "pdserve.kv_transfer.connector"
# Methods vLLM adds to its Worker for in-place updates from a checkpoint folder.
WORKER_EXTENSION = "pdserve.worker.vllm.weights_ext.WeightsExtension"
logger = logging.getLogger("pdserve.worker")
# vLLM's weight-transfer engines, for weights a trainer pushes (both need GPUs).
WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc", "gloo")
# Those that move tensors GPU to GPU (gloo: host memory, ``gloo_transfer.py``).
GPU_WEIGHT_TRANSFER_BACKENDS = ("nccl", "ipc")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    served_model_name: str
    role: Role
    connector: ConnectorConfig
    dtype: str = "auto"
    max_model_len: int = 4096
    kv_cache_gib: int = 2
    # Cores for the engine's compute threads (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "0-1".
    cpu_threads_bind: str | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64
    # torch.compile on 2 CPU cores costs ~90 s per engine start; eager starts in seconds.
    enforce_eager: bool = True
    # KV cache size in blocks; overrides kv_cache_gib (vLLM's num_gpu_blocks_override).
    num_kv_blocks: int | None = None
    # Publish vLLM's KV cache events on ZMQ sockets of this name in the engine's folder
    # (``KvEventEndpoints.for_worker``); the host mirrors them for the routers' prefix
    # index, whatever the role (None: no events).
    kv_events: str | None = None
    # vLLM's shared-memory readers' busy-wait (pdserve.worker.vllm.plugin); None: 0 on
    # CPU (or PDSERVE_VLLM_SHM_SPIN_S), vLLM's own on GPU.
    shm_spin_s: float | None = None
    # The per-step prefill-token budget of one request while others run (vLLM's
    # long_prefill_token_threshold; chunked prefill): a long prompt prefilled beside
    # decoding streams takes several steps of at most this many tokens, so no stream
    # waits for the whole prompt. Alone in the engine (a prefill worker's usual case)
    # a prompt is not cut. 0: no cap.
    prefill_chunk_tokens: int = 0
    # The prefill role's admission in front of the engine (roles/prefill/admission.py):
    # at most this many prompts in the engine at once (0: no limit), the rest waiting in
    # ``prefill_order``. Outside the engine: a role switch carries it, no restart.
    prefill_max_running: int = 0
    prefill_order: str = "shortest"
    # The version the weights it starts with serve under (vLLM's "default"; a worker
    # started on a later checkpoint names that checkpoint's version).
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # vLLM's weight-transfer engine for updates pushed by a trainer ("nccl", "ipc":
    # GPUs; "gloo": CPUs, gloo_transfer.py); None: updates come from checkpoint folders
    # only.
    weight_transfer_backend: str | None = None
    # LoRA adapters (--enable-lora, --lora-modules, --max-loras, --max-lora-rank).
    lora: LoraConfig = LoraConfig()

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be 'prefill' or 'decode', not {self.role!r}")
        if self.max_model_len < 16:
            raise ValueError("max_model_len must be >= 16")
        if self.kv_cache_gib <= 0:
            raise ValueError("kv_cache_gib must be > 0")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError("num_kv_blocks must be >= 2")
        if self.shm_spin_s is not None and self.shm_spin_s < 0:
            raise ValueError("shm_spin_s must be >= 0")
        if self.prefill_chunk_tokens < 0 or 0 < self.prefill_chunk_tokens < 16:
            raise ValueError("prefill_chunk_tokens must be 0 (no cap) or >= 16")
        if not self.weight_version.strip():  # it names the weights in hashes and salts
            raise ValueError("weight_version must not be empty")
        if any(m.name == self.served_model_name for m in self.lora.modules):
            raise ValueError(f"--lora-modules: {self.served_model_name!r} is the served "
                             "model's name, not an adapter's")
        if self.weight_transfer_backend not in (None, *WEIGHT_TRANSFER_BACKENDS):
            raise ValueError(f"weight_transfer_backend must be one of "
                             f"{', '.join(WEIGHT_TRANSFER_BACKENDS)} (or unset), not "
                             f"{self.weight_transfer_backend!r}")


@dataclass(frozen=True)
class EngineParams:
    """What a role policy decides for one request beyond its sampling spec."""

    max_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    # The last this-many prompt tokens are output already produced (PhaseRequest's).
    num_output_in_prompt: int = 0
    # Prompt logprobs to compute (top-k per position), where this call computes the prompt.
    prompt_logprobs: int | None = None
    # The LoRA adapter the call runs (None: the base model).
    lora: LoadedLora | None = None


@dataclass(frozen=True)
class EngineStep:
    """One engine output: the tokens since the previous one (vLLM's DELTA kind).
    ``finish_reason`` is the engine's own word; the host maps it."""

    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    num_cached_tokens: int = 0
    # On the finished step, from the engine's request stats (0: not reported):
    # queued -> first scheduled, and first scheduled -> first token.
    queue_ns: int = 0
    compute_ns: int = 0
    logprobs: tuple[TokenLogprobs, ...] = ()  # per token of token_ids, when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # on the first step, when asked


class Engine(Protocol):
    """A running engine as ``EngineHost`` drives it. ``generate`` streams one
    request and aborts it in the engine when closed early, and raises ``ValueError`` for
    a request the engine refuses as invalid (the servicer answers INVALID_ARGUMENT);
    ``abort`` stops one by id (a no-op for an unknown id)."""

    @property
    def block_size(self) -> int: ...

    @property
    def dtype(self) -> str: ...

    @property
    def num_kv_blocks(self) -> int: ...

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingSpec, params: EngineParams
                 ) -> AsyncGenerator[EngineStep, None]: ...

    async def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None:
        """Stop the engine, and the mirroring of its KV events with it."""
        ...

    # ---- what the host reports of it (GetLoad, StreamKvEvents) ----

    def mirror_kv_events(self, loop: asyncio.AbstractEventLoop) -> KvCacheMirror | None:
        """Start mirroring the engine's KV events (blocks stored, removed, cleared) on the
        event loop ``loop``; the mirror, or None when the engine publishes none. Called
        once, on ``loop``, after the engine started."""
        ...

    def kv_status(self) -> dict[str, Any]:
        """The KV connector's own counters (``host.load_report`` reads them: leases,
        transfers, links, the measured step cost); its last reply when this one is late
        or fails. Blocking: called off the event loop."""
        ...

    # ---- LoRA adapters (``pdserve.worker.lora.adapters``) ----

    async def add_lora(self, lora: LoadedLora) -> None:
        """Load ``lora`` into the engine now; ``ValueError`` for a folder it refuses."""
        ...

    async def remove_lora(self, lora_id: int) -> None: ...

    # ---- weights (``pdserve.worker.weights``) ----

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        """Read a checkpoint into host memory; ``ValueError`` for one that is not the
        served model's layout."""
        ...

    async def commit_weights(self, version: str) -> None:
        """Serve the staged weights under ``version``, in place; empty the prefix cache
        and the KV tiers' entries."""
        ...

    async def discard_weights(self) -> bool: ...

    async def weight_call(self, call: WeightCall) -> str:
        """One of vLLM's weight-transfer calls; the version served after it
        (``ValueError``: a call vLLM's engine refuses)."""
        ...


@dataclass
class EngineCounters:
    """Cumulative engine counters, updated from vLLM's stat-logger callbacks."""

    prompt_tokens_computed: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, sched: SchedulerStats | None, it: IterationStats | None) -> None:
        with self.lock:
            if it is not None:
                pts = it.prompt_token_stats
                self.prompt_tokens_computed += pts.computed
                self.prompt_tokens_local_cache_hit += pts.local_cache_hit
                self.prompt_tokens_external += pts.external_kv_transfer
            if sched is not None:
                self.num_running_reqs = sched.num_running_reqs
                self.num_waiting_reqs = sched.num_waiting_reqs + sched.num_skipped_waiting_reqs
                self.kv_cache_usage = sched.kv_cache_usage


def _stat_logger_factory(counters: EngineCounters) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class CountersLogger(StatLoggerBase):
        def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
            self._counters = counters

        def record(
            self,
            scheduler_stats: SchedulerStats | None,
            iteration_stats: IterationStats | None,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            self._counters.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            return

    return CountersLogger


def _quiet_shm_spin(spin_s: float | None) -> None:
    """The engine's processes busy-wait ``spin_s`` between messages (None: not at all
    on CPU, where the compute threads need the cores; vLLM's own 1 s on GPU), and their
    wake-up pings are never lost (``pdserve.worker.vllm.plugin``). An explicit
    ``PDSERVE_VLLM_SHM_SPIN_S`` wins over the CPU default. Applied here too: forked
    engine processes inherit it even where the plugin's entry point is shadowed (a
    stale ``pdserve.egg-info`` in the working directory); spawned ones inherit the
    variable and the plugin applies it there."""
    from vllm.platforms import current_platform

    from pdserve.worker.vllm.plugin import SPIN_ENV, register

    if spin_s is not None:
        os.environ[SPIN_ENV] = repr(spin_s)
    elif current_platform.is_cpu():
        os.environ.setdefault(SPIN_ENV, "0")
    register()


def build_engine(config: EngineConfig, counters: EngineCounters,
                 kv_events: tuple[str, str] | None = None) -> AsyncLLM:
    """Start the engine (blocks ~20-40 s on CPU), publishing its KV events on
    ``kv_events`` (pub, replay; None: none). Call from a ``__main__``-guarded process."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(config.kv_cache_gib)
    engine_folder()  # the operator's VLLM_RPC_BASE_PATH, else a folder of its own
    if config.cpu_threads_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = config.cpu_threads_bind
    _quiet_shm_spin(config.shm_spin_s)
    dtype = resolve_dtype(config.dtype, model_path=config.model_path)
    logger.info("%s engine: %s", config.role, dtype.describe())
    from vllm.config import KVEventsConfig, KVTransferConfig, WeightTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    kv_config = KVTransferConfig(
        kv_connector="PdserveConnector",
        kv_connector_module_path=CONNECTOR_MODULE,
        # Both directions in every engine: a role is the worker's state, switched at
        # run time without a restart (``EngineHost.set_role``); the connector decides
        # per request from its kv_transfer_params, never from kv_role.
        kv_role="kv_both",
        engine_id=config.connector.engine_id,
        kv_connector_extra_config=config.connector.to_extra_config(),
        kv_load_failure_policy="recompute",
    )
    args = AsyncEngineArgs(
        model=config.model_path,
        served_model_name=[config.served_model_name],
        dtype=dtype.dtype,
        max_model_len=config.max_model_len,
        enable_prefix_caching=config.enable_prefix_caching,
        kv_transfer_config=kv_config,
        max_num_seqs=config.max_num_seqs,
        enforce_eager=config.enforce_eager,
        num_gpu_blocks_override=config.num_kv_blocks,
        # vLLM refuses a threshold above max_model_len (no prompt is longer anyway).
        long_prefill_token_threshold=min(config.prefill_chunk_tokens, config.max_model_len),
        kv_events_config=None if kv_events is None else KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=kv_events[0],
            replay_endpoint=kv_events[1]),
        # Penalties count the output a decode call gets inside its prompt.
        logits_processors=[OUTPUT_IN_PROMPT_PROCESSOR],
        worker_extension_cls=WORKER_EXTENSION,
        weight_transfer_config=None if config.weight_transfer_backend is None else
        WeightTransferConfig(backend=config.weight_transfer_backend),
        enable_lora=config.lora.enable_lora, max_loras=config.lora.max_loras,
        max_lora_rank=cast(Any, config.lora.max_lora_rank),  # LoraConfig checks the rank
        # Every adapter served stays in host memory (vLLM's LRU would evict and reload).
        max_cpu_loras=max(config.lora.max_loras, len(config.lora.modules), 8)
        if config.lora.enable_lora else None,
    )
    return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(counters)])
