"""``EngineHost``: one engine in-process behind the ``WorkerBackend`` contract,
the same for both roles. It owns the engine's lifecycle, the in-flight set, the
output stream and the mirror of the engine's KV events (the prefix cache is the
engine's, whatever its role: the routers place prefills and decodes on it); every
role decision goes to its ``RolePolicy``."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pdserve.core.kv_store_id import kv_store_id
from pdserve.core.lora import LoraAdapter
from pdserve.core.types import (
    FinishReason,
    KvLink,
    PhaseOutput,
    PhaseRequest,
    PhaseTiming,
    Role,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.core.weight_calls import UpdateWeightVersion, WeightCall
from pdserve.kv_transfer.handoff_codec import STATS as ENCODED_STATS
from pdserve.kv_transfer.reported import STORE_STATS, TIER_STATS
from pdserve.worker.backend import WorkerError
from pdserve.worker.engine import Engine, EngineConfig, EngineCounters, EngineStep
from pdserve.worker.lora.host import LoraHost
from pdserve.worker.policy import AdmissionAborted, RolePolicy
from pdserve.worker.timing import PhaseClock
from pdserve.worker.weights import WeightsState

if TYPE_CHECKING:
    from pdserve.worker.kv.mirror import KvCacheMirror

logger = logging.getLogger("pdserve.worker")
EngineFactory = Callable[[EngineConfig, EngineCounters], Engine]
PolicyFactory = Callable[[Role], RolePolicy]
_FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "abort", "error")


class EngineHost:
    """``engine_factory`` starts the engine (``VllmEngine.start`` in a worker, a
    ``SimEngine`` in a simulated one, a fake in tests); ``kv_push`` says whether this
    worker sends (prefill) or accepts (decode) layer-wise push; ``metrics_endpoint`` is
    where its ``/metrics`` listener is reached ("" when off), as its Health says.
    ``policy_for`` builds a role's policy for a role switch (``set_role``); None: the
    role is fixed."""

    def __init__(self, config: EngineConfig, worker_id: str, policy: RolePolicy,
                 engine_factory: EngineFactory, kv_push: bool = False,
                 metrics_endpoint: str = "", policy_for: PolicyFactory | None = None) -> None:
        if policy.role != config.role:
            raise ValueError(f"a {policy.role} policy cannot host a {config.role} engine")
        self.config = config
        self.worker_id = worker_id
        self.policy = policy
        self.kv_push = kv_push
        self.metrics_endpoint = metrics_endpoint
        self.counters = EngineCounters()
        self.engine: Engine | None = None
        self._engine_factory = engine_factory
        self._policy_for = policy_for
        self._inflight: set[str] = set()
        # Fixed while the engine runs; the servicer checks every Generate against it.
        self._health: WorkerHealth | None = None
        # The engine's KV-event mirror, once ``start_mirroring`` asked for it.
        self._mirror: KvCacheMirror | None = None
        self._mirroring = False
        self.weights = WeightsState(version=config.weight_version)
        self.lora = LoraHost(config.lora, worker_id, self._running_engine, self.abort,
                             self._lora_changed)
        self.loras = self.lora.table

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        """Load the engine (blocking; tens of seconds with vLLM)."""
        self.engine = self._engine_factory(self.config, self.counters)
        self._health = None

    def start_mirroring(self, loop: asyncio.AbstractEventLoop) -> None:
        """Mirror the engine's KV events, when it publishes them (call on the event loop
        ``loop`` once the engine runs). A role switch keeps the mirror: same engine, same
        prefix cache."""
        if self.engine is not None and not self._mirroring:
            self._mirror = self.engine.mirror_kv_events(loop)
            self._mirroring = True

    def set_role(self, role: Role) -> None:
        """Serve ``role`` with the same engine (weights, prefix cache and its KV-event
        mirror stay) under that role's policy. Only with nothing in flight (the servicer
        drains first); the KV connector serves both directions in every engine."""
        if role == self.policy.role:
            return
        if self._policy_for is None:
            raise WorkerError("unimplemented", f"this {self.policy.role} worker's role is fixed")
        if self._inflight:
            raise WorkerError("failed_precondition",
                              f"{len(self._inflight)} requests in flight; drain first")
        self.policy = self._policy_for(role)
        self.config = replace(self.config, role=role)
        self._health = None
        logger.info("worker %s now serves %s", self.worker_id, role)

    async def end_role_work(self) -> tuple[int, int]:
        """A role switch's drain ran out: abort what is in flight (a decode's stream then
        ends ``abort`` and the router continues it elsewhere) and release the KV leases
        the role holds; (requests aborted, leases the connector held)."""
        aborted = list(self._inflight)
        for request_id in aborted:
            await self.abort(request_id)
        held = int((await asyncio.to_thread(self.kv_status)).get("num_leases", 0))
        await self.policy.release_all()
        return len(aborted), held

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()  # its KV events' mirroring with it
            self.engine = None
            self._health = None
        self._mirror, self._mirroring = None, False

    def health(self) -> WorkerHealth:
        """What this worker says about itself; built once per engine lifetime."""
        if self._health is None:
            self._health = self._describe()
        return self._health

    def _describe(self) -> WorkerHealth:
        cfg, conn = self.config, self.config.connector
        dtype, block_size = cfg.dtype, 0
        if self.engine is not None:
            dtype, block_size = self.engine.dtype, self.engine.block_size
        compat = {"model": cfg.served_model_name, "dtype": dtype, "block_size": block_size,
                  "transport": conn.transport, "weights": self.weights.version}
        digest = hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]
        return WorkerHealth(
            ready=self.ready, role=self.policy.role, worker_id=self.worker_id,
            model=cfg.served_model_name, dtype=dtype, block_size=block_size,
            max_model_len=cfg.max_model_len, transport=conn.transport,
            compatibility_hash=digest, kv_host=conn.kv_host, kv_port=conn.kv_port,
            kv_push=self.kv_push, metrics_endpoint=self.metrics_endpoint,
            prefill_chunk_tokens=cfg.prefill_chunk_tokens, weight_version=self.weights.version,
            weights_path=self.weights.path, kv_store_id=kv_store_id(conn.kv_store),
            kv_store_ttl_s=conn.kv_store_ttl_s if conn.kv_store else 0.0,
            kv_compression=conn.kv_compression, loras=self.loras.adapters)

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        engine = self.engine
        if engine is None:
            raise WorkerError("unavailable", "engine is loading")
        request, lora = self.loras.request(request)
        request = self.weights.request(request)
        version = self.weights.version  # the call's; no commit while it runs
        clock = PhaseClock()
        params = self.policy.engine_params(request)
        if lora is not None:
            params = replace(params, lora=lora)
        self._inflight.add(request.request_id)
        self.lora.runs.started(request.request_id, lora)
        try:
            async with self.policy.admitted(request) as waited_s:
                clock.waited_ns = int(waited_s * 1e9)
                steps = engine.generate(request.request_id, request.prompt_token_ids,
                                        request.sampling, params)
                async with contextlib.aclosing(steps):
                    async for step in steps:
                        clock.on_output(step.token_ids)
                        yield self._output(request, step, clock, version)
                        version = ""  # named on the first output only
        except AdmissionAborted:  # aborted before its turn: it ends as an engine abort does
            yield self._output(request, EngineStep((), finished=True, finish_reason="abort"),
                               clock, version)
        finally:
            self._inflight.discard(request.request_id)
            self.lora.runs.ended(request.request_id)

    def _output(self, request: PhaseRequest, step: EngineStep, clock: PhaseClock,
                version: str) -> PhaseOutput:
        """``version``: the weights version to name ("" after the call's first output)."""
        if not step.finished:
            return PhaseOutput(step.token_ids, None, None, step.num_cached_tokens,
                               len(request.prompt_token_ids), logprobs=step.logprobs,
                               prompt_logprobs=step.prompt_logprobs, weight_version=version)
        handle = self.policy.on_finished(request, step.kv_transfer_params)
        return PhaseOutput(
            token_ids=step.token_ids, finish_reason=_finish_reason(step.finish_reason),
            kv_handle=None if handle is None else replace(
                handle, weight_version=self.weights.version),
            num_cached_tokens=step.num_cached_tokens,
            num_prompt_tokens=len(request.prompt_token_ids), timing=_timing(request, step, clock),
            logprobs=step.logprobs, prompt_logprobs=step.prompt_logprobs,
            weight_version=version)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request and release whatever its role holds for it."""
        found = request_id in self._inflight
        if self.policy.abort_waiting(request_id):
            pass  # it never entered the engine
        elif found and self.engine is not None:
            await self.engine.abort(request_id)
        released = await self.policy.release(request_id)
        return found or released

    # ---- LoRA adapters (``pdserve.worker.lora.host``) --------------------------------

    async def start_loras(self) -> None:
        await self.lora.start()

    async def load_lora(self, adapter: LoraAdapter) -> bool:
        return await self.lora.load(adapter)

    async def unload_lora(self, name: str) -> bool:
        return await self.lora.unload(name)

    def _lora_changed(self) -> None:
        self._health = None  # described again: what it serves changed

    # ---- weights (``pdserve.worker.weights``) ---------------------------------------

    def _running_engine(self) -> Engine:
        if self.engine is None:
            raise WorkerError("unavailable", "engine is loading")
        return self.engine

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        """Read ``model_path`` for a commit as ``version``; the engine serves on meanwhile."""
        engine = self._running_engine()
        self.weights.check_stage(model_path, version)
        self.weights.staged = None  # whatever was staged before is replaced
        staged = await engine.stage_weights(model_path, version)
        self.weights.staged = (version, model_path)
        logger.info("staged weights %s from %s (%d tensors, %.0f MB) in %.2f s", version,
                    model_path, staged.num_tensors, staged.num_bytes / 1e6, staged.stage_ns / 1e9)
        return staged

    async def commit_weights(self, version: str) -> None:
        """Serve the staged weights as ``version``. Only with nothing in flight (the
        servicer drains first)."""
        engine = self._running_engine()
        path = self.weights.check_commit(version)
        if self._inflight:
            raise WorkerError("failed_precondition",
                              f"{len(self._inflight)} requests in flight; drain first")
        await engine.commit_weights(version)
        self.weights.committed(version, path)
        self._health = None
        logger.info("worker %s now serves weights %s (%s)", self.worker_id, version, path)

    async def discard_weights(self) -> bool:
        self.weights.staged = None
        return await self._running_engine().discard_weights()

    async def engine_weight_call(self, call: WeightCall) -> str:
        """vLLM's own weight-transfer call; the version served after it."""
        if not isinstance(call, UpdateWeightVersion) and \
                self.config.weight_transfer_backend is None:
            # vLLM would fail deep in its engine (an internal error, a 500 at the router):
            # a call this worker was not started for is the caller's mistake.
            raise WorkerError("failed_precondition", f"{call.name}: weight transfer is off "
                              "on this worker (start it with --weight-transfer-backend)")
        version = await self._running_engine().weight_call(call)
        if version != self.weights.version:
            self.weights.committed(version, "")
            self._health = None
        return version

    def kv_mirror(self) -> KvCacheMirror | None:
        if not self._mirroring:
            raise WorkerError("unavailable", "engine is loading")
        return self._mirror

    def kv_status(self) -> dict[str, Any]:
        """The KV connector's own counters (blocking; {} while the engine loads)."""
        engine = self.engine
        return {} if engine is None else engine.kv_status()

    async def load(self) -> WorkerLoadReport:
        self.policy.prune(time.time_ns())
        status = await asyncio.to_thread(self.kv_status) if self.ready else {}
        mirror = self._mirror
        return load_report(self.counters, status, self.num_inflight,
                           len(mirror) if mirror is not None else 0, self.policy.num_waiting)


def load_report(c: EngineCounters, status: dict[str, Any], num_inflight: int,
                num_cached_blocks: int, num_admission_waiting: int = 0) -> WorkerLoadReport:
    """The engine's counters plus the connector's ``status`` reply; requests waiting in
    front of the engine (the role's admission) count as waiting."""

    def stat(name: str) -> int:
        return int(status.get(name, 0))

    with c.lock:
        return WorkerLoadReport(
            num_running_reqs=c.num_running_reqs,
            num_waiting_reqs=c.num_waiting_reqs + num_admission_waiting,
            kv_cache_usage=c.kv_cache_usage,
            num_pending_transfers=stat("num_leases") + stat("inflight_pulls"),
            prompt_tokens_computed=c.prompt_tokens_computed,
            prompt_tokens_local_cache_hit=c.prompt_tokens_local_cache_hit,
            prompt_tokens_external=c.prompt_tokens_external,
            kv_bytes_sent=stat("bytes_sent"), kv_bytes_received=stat("bytes_received"),
            kv_transfers_completed=stat("transfers_completed"),
            kv_transfers_failed=stat("transfers_failed"),
            kv_transfer_time_ns=stat("transfer_time_ns"), num_inflight_reqs=num_inflight,
            kv_leases_expired=stat("leases_expired"), kv_loads=stat("loads"),
            kv_load_time_ns=stat("load_time_ns"), kv_push_loads=stat("push_loads"),
            kv_push_fallbacks=stat("push_fallbacks"), kv_layers_pushed=stat("layers_pushed"),
            kv_pushes_failed=stat("pushes_failed"), num_cached_blocks=num_cached_blocks,
            kv_leases_held=stat("num_leases"), kv_push_inbox_bytes=stat("push_inbox_bytes"),
            step_base_us=stat("step_base_us"), step_per_seq_us=stat("step_per_seq_us"),
            step_per_token_ns=stat("step_per_token_ns"),
            step_decode_samples=stat("step_decode_samples"),
            step_prefill_samples=stat("step_prefill_samples"),
            kv_links=tuple(KvLink(str(link["peer"]), float(link["bytes_per_s"]),
                                  float(link["bytes_per_token"]), int(link["samples"]),
                                  float(link["age_s"])) for link in status.get("links", ())),
            **{f"kv_{name}": stat(name) for name in (*TIER_STATS, *STORE_STATS,
                                                      *ENCODED_STATS)})


def _timing(request: PhaseRequest, step: EngineStep, clock: PhaseClock) -> PhaseTiming:
    """vLLM schedules a decode that loads KV only once the load is done, and reports no
    load time of its own: a decode with a handle counts its whole queue wait as the load
    (an upper bound: it includes any wait for a slot before the load began)."""
    kv_load_ns = step.queue_ns if request.kv_handle is not None else 0
    return clock.timing(step.queue_ns, step.compute_ns, kv_load_ns)


def _finish_reason(reason: str | None) -> FinishReason:
    for known in _FINISH_REASONS:
        if reason == known:
            return known
    return "stop" if reason is None else "error"

