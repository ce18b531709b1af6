"""The simulated worker: a ``SimEngine`` behind the same gRPC ``WorkerService``
(``pdserve.worker.servicer``) a vLLM worker runs.

``pdserve sim-worker --role prefill --port 50051`` (its config is built by
``pdserve.cli.configs.sim_config``). Tokens are made up; timing, prefix caching and KV events
are modelled. Its weights change in place as a vLLM worker's do (``WeightsBackend``),
with the same rules (``pdserve.worker.weights``): a call's tokens come from one
version, and KV crosses workers only within one. For router-scale tests and benchmarks only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncGenerator

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.handle import KVHandle
from pdserve.core.types import (
    PhaseOutput,
    PhaseRequest,
    Role,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.core.weight_calls import WeightCall, version_set_by
from pdserve.membership import Registrar, WorkerInfo
from pdserve.membership.static import NullRegistrar
from pdserve.worker.backend import WorkerError
from pdserve.worker.kv_mirror import KvCacheMirror
from pdserve.worker.metrics import MetricsListener, start_worker_metrics
from pdserve.worker.servicer import WorkerServer, start_worker_server
from pdserve.worker.sim_engine import SimConfig, SimEngine
from pdserve.worker.timing import PhaseClock
from pdserve.worker.weights import WeightsState

logger = logging.getLogger("pdserve.sim_worker")


class SimHost:
    """The ``WorkerBackend`` of a simulated worker; ``metrics_endpoint``: where its
    ``/metrics`` listener is reached ("" when off)."""

    def __init__(self, engine: SimEngine, metrics_endpoint: str = "") -> None:
        self.engine = engine
        self.metrics_endpoint = metrics_endpoint
        self.role: Role = engine.config.role  # switched by ``set_role``
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()  # in flight, told to stop: ends at its next token
        self.weights = WeightsState(version=engine.config.weight_version)

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        request = self.weights.request(request)  # another version's KV handle: refused
        version = self.weights.version  # the call's; no commit while it runs
        self._inflight.add(request.request_id)
        clock = PhaseClock()
        try:
            if self.role == "prefill":
                yield await self._prefill(request, clock, version)
                return
            async for out in self._decode(request, clock, version):
                yield out
        finally:
            self._inflight.discard(request.request_id)
            self._aborted.discard(request.request_id)

    async def _decode(self, request: PhaseRequest, clock: PhaseClock, version: str
                      ) -> AsyncGenerator[PhaseOutput, None]:
        """One message per token, as they are made (the first one naming the weights
        ``version``, the last one with the timing: no queue, no KV load, the first
        token's step as the compute)."""
        prompt, n = request.prompt_token_ids, request.sampling.max_tokens
        # With a KV handle the prompt ends with the prefill's first token: continue
        # the prompt's answer from its second token, so the text does not depend on
        # whether the prompt was prefilled here (fallback, local) or remotely.
        first_index = 1 if request.kv_handle is not None else 0
        self.engine.hold(prompt, request.sampling.cache_salt)
        i = 0
        async for t in self.engine.decode(prompt[:len(prompt) - first_index], n, first_index):
            if request.request_id in self._aborted:  # as vLLM ends an aborted request
                yield PhaseOutput((), finish_reason="abort", weight_version=version)
                return
            clock.on_output((t,))
            i += 1
            if i < n:
                yield PhaseOutput(token_ids=(t,), weight_version=version)
                version = ""  # named on the first output only
                continue
            compute_ns = clock.first_token_unix_ns - clock.admitted_unix_ns
            yield PhaseOutput(token_ids=(t,), finish_reason="length",
                              num_prompt_tokens=len(prompt),
                              timing=clock.timing(compute_ns=compute_ns),
                              weight_version=version)

    async def _prefill(self, request: PhaseRequest, clock: PhaseClock, version: str
                       ) -> PhaseOutput:
        prompt = request.prompt_token_ids
        run = await self.engine.prefill_timed(prompt, request.sampling.cache_salt)
        cached = run.num_cached_tokens
        clock.on_output((0,))
        handle = None
        if request.sampling.max_tokens > 1:
            handle = KVHandle(
                engine_id=self.engine.config.worker_id, remote_request_id=request.request_id,
                block_ids=(), num_tokens=len(prompt), transport="sim", host="", port=0,
                transfer_id=request.request_id, lease_deadline_unix_ns=0,
                weight_version=version)
        return PhaseOutput(token_ids=(self.engine.token(prompt, 0),), finish_reason="length",
                           kv_handle=handle, num_cached_tokens=cached,
                           num_prompt_tokens=len(prompt),
                           timing=clock.timing(run.queue_ns, run.compute_ns),
                           weight_version=version)

    async def abort(self, request_id: str) -> bool:
        found = request_id in self._inflight
        if found:
            self._aborted.add(request_id)
        return found

    def health(self) -> WorkerHealth:
        cfg, weights = self.engine.config, self.weights
        compat = f"sim-{cfg.block_size}"  # workers of one version pair (the first: as before)
        if weights.version != DEFAULT_WEIGHT_VERSION:
            compat += f"@{weights.version}"
        return WorkerHealth(
            ready=True, role=self.role, worker_id=cfg.worker_id, model="sim", dtype="sim",
            block_size=cfg.block_size, max_model_len=cfg.max_model_len, transport="sim",
            compatibility_hash=compat, metrics_endpoint=self.metrics_endpoint,
            weight_version=weights.version, weights_path=weights.path)

    async def load(self) -> WorkerLoadReport:
        c, cfg = self.engine.counters, self.engine.config
        return WorkerLoadReport(
            num_running_reqs=c.num_running_reqs, num_waiting_reqs=c.num_waiting_reqs,
            kv_cache_usage=self.engine.kv_cache_usage,
            prompt_tokens_computed=c.prompt_tokens_computed,
            prompt_tokens_local_cache_hit=c.prompt_tokens_local_cache_hit,
            num_inflight_reqs=len(self._inflight), num_cached_blocks=len(self.engine.mirror),
            # Its cost model as an engine's measured step fit (streams decode side by
            # side: a sequence adds nothing to a step).
            step_base_us=round(cfg.decode_s_per_token * 1e6), step_per_seq_us=0,
            step_per_token_ns=round(cfg.prefill_s_per_token * 1e9), step_decode_samples=1,
            step_prefill_samples=1)

    def kv_mirror(self) -> KvCacheMirror | None:
        return self.engine.mirror

    def set_role(self, role: Role) -> None:
        self.role = role

    async def end_role_work(self) -> tuple[int, int]:
        """Past a drain: abort what is in flight (a decode stream ends at its next token)."""
        aborted = list(self._inflight)
        for request_id in aborted:
            await self.abort(request_id)
        return len(aborted), 0

    # ---- weights (``pdserve.worker.weights``; as ``EngineHost``'s) --------------------

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        """Stage ``model_path`` (an existing folder) for a commit as ``version``."""
        self.weights.check_stage(model_path, version)
        self.weights.staged = None  # whatever was staged before is replaced
        staged = await self.engine.stage_weights(model_path)
        self.weights.staged = (version, model_path)
        return staged

    async def commit_weights(self, version: str) -> None:
        """Serve the staged weights as ``version``; only with nothing in flight."""
        path = self.weights.check_commit(version)
        if self._inflight:
            raise WorkerError("failed_precondition",
                              f"{len(self._inflight)} requests in flight; drain first")
        self.engine.load_weights(version)
        self.weights.committed(version, path)
        logger.info("simulated worker %s now serves weights %s (%s)",
                    self.engine.config.worker_id, version, path)

    async def discard_weights(self) -> bool:
        discarded = self.weights.staged is not None
        self.weights.staged = None
        return discarded

    async def engine_weight_call(self, call: WeightCall) -> str:
        """vLLM's weight-transfer calls: only those naming a version change it (no
        tensors move in a simulator); the version served after the call."""
        version = version_set_by(call)
        if version is not None and str(version) != self.weights.version:
            self.engine.load_weights(str(version))
            self.weights.committed(str(version), "")
        return self.weights.version


async def serve_sim_worker(config: SimConfig, host: str, port: int,
                           registrar: Registrar | None = None,
                           secret: ClusterSecret | None = None,
                           tls: GrpcTls | None = None,
                           keepalive_s: float = DEFAULT_KEEPALIVE_S,
                           drain_timeout_s: float = 30.0,
                           metrics: MetricsListener | None = None) -> None:
    """Serve until SIGTERM/SIGINT, registered with ``registrar`` (etcd) meanwhile, as a
    vLLM worker is once ready, and ``/metrics`` on ``metrics`` (if its port is set);
    then drain as a vLLM worker does (``serve_worker``)."""
    registrar = registrar or NullRegistrar()
    engine = SimEngine(config)
    backend = SimHost(engine, metrics.endpoint if metrics else "")
    worker: WorkerServer = await start_worker_server(
        backend, host, port, keepalive_s, secret=secret, tls=tls)
    metrics_server = start_worker_metrics(metrics, backend, worker.state) if metrics else None
    logger.info("simulated %s worker %s on %s:%d", config.role, config.worker_id, host,
                worker.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await registrar.start(sim_worker_info(backend, host, worker.port))
        await stop.wait()
    finally:
        logger.info("simulated worker draining (up to %.0f s)", drain_timeout_s)
        await worker.drain(drain_timeout_s, registrar.close)
        if metrics_server is not None:  # off the loop: a scrape in progress waits on it
            await asyncio.to_thread(metrics_server.close)


def sim_worker_info(host_backend: SimHost, host: str, port: int) -> WorkerInfo:
    """What a simulated worker registers: its Health's identity, no KV endpoint."""
    health = host_backend.health()
    return WorkerInfo(worker_id=health.worker_id, role=health.role,
                      grpc_endpoint=f"{sim_advertise_host(host)}:{port}", model=health.model,
                      dtype=health.dtype, block_size=health.block_size,
                      compatibility_hash=health.compatibility_hash,
                      max_model_len=health.max_model_len,
                      metrics_endpoint=health.metrics_endpoint)


def sim_advertise_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host
