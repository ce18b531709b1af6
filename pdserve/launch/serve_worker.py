"""Runs one worker process: the gRPC ``WorkerService`` in front of an in-process
vLLM engine, with the role's policy. Health answers "not ready" while the engine
loads; the worker registers once it is ready. SIGTERM drains it (``WorkerServer.drain``):
NOT_SERVING, withdrawn from membership, in-flight requests finished within the drain
timeout, then exit."""

from __future__ import annotations

import asyncio
import functools
import logging
import signal

from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.types import Role
from pdserve.kv_transfer.base import push_transport_names
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.membership import Registrar, WorkerInfo
from pdserve.membership.static import NullRegistrar
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.roles.prefill.admission import AdmissionConfig
from pdserve.roles.prefill.handle_leases import release_over_control
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.worker.engine import EngineConfig
from pdserve.worker.host import EngineHost
from pdserve.worker.metrics import MetricsListener, start_worker_metrics
from pdserve.worker.policy import RolePolicy
from pdserve.worker.servicer import start_worker_server
from pdserve.worker.vllm.engine import VllmEngine

logger = logging.getLogger("pdserve.worker")
DEFAULT_DRAIN_TIMEOUT_S = 30.0


def kv_push_enabled(connector: ConnectorConfig) -> bool:
    """Whether this worker sends (prefill) or accepts (decode) layer-wise push."""
    return connector.push and connector.transport in push_transport_names()


def role_policy(config: EngineConfig, kv_push: bool, role: Role | None = None) -> RolePolicy:
    """``role``'s policy (default: the configured one) for this worker's engine."""
    if (role or config.role) == "prefill":
        release = functools.partial(release_over_control, secret=config.connector.cluster_secret(),
                                    tls=config.connector.kv_tls())
        admission = AdmissionConfig(config.prefill_max_running, config.prefill_order)
        return PrefillPolicy(kv_push=kv_push, release=release, admission=admission)
    return DecodePolicy()


def engine_host(config: EngineConfig, worker_id: str, metrics_endpoint: str = ""
                ) -> EngineHost:
    """The vLLM engine host for ``config``'s role (the engine starts on ``start``)."""
    kv_push = kv_push_enabled(config.connector)
    return EngineHost(config, worker_id, role_policy(config, kv_push), VllmEngine.start,
                      kv_push=kv_push, metrics_endpoint=metrics_endpoint,
                      policy_for=functools.partial(role_policy, config, kv_push))


def worker_info(host: EngineHost, advertise_host: str, grpc_port: int) -> WorkerInfo:
    """What this worker registers (docs/architecture.md, "Membership"), once its engine is ready."""
    health = host.health()
    cfg = host.config
    capacity: dict[str, float] = {"kv_cache_gib": cfg.kv_cache_gib,
                                  "max_num_seqs": cfg.max_num_seqs}
    if host.engine is not None:
        capacity["num_kv_blocks"] = host.engine.num_kv_blocks
    conn = cfg.connector
    return WorkerInfo(
        worker_id=host.worker_id, role=host.policy.role,
        grpc_endpoint=f"{advertise_host}:{grpc_port}",
        kv_endpoints={conn.transport: f"{conn.kv_host}:{conn.kv_port}"},
        model=cfg.served_model_name, dtype=health.dtype, block_size=health.block_size,
        compatibility_hash=health.compatibility_hash, max_model_len=cfg.max_model_len,
        capacity=capacity, metrics_endpoint=host.metrics_endpoint,
    )


async def serve_worker(config: EngineConfig, worker_id: str, host: str, port: int,
                       registrar: Registrar | None = None,
                       advertise_host: str | None = None,
                       keepalive_s: float = DEFAULT_KEEPALIVE_S,
                       drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, *,
                       tls: GrpcTls | None = None,
                       metrics: MetricsListener | None = None) -> None:
    """Serve until SIGTERM/SIGINT, and ``/metrics`` on ``metrics`` (if its port is set)
    from the start. Registers with ``registrar`` once the engine is ready; on the way
    out drains: says NOT_SERVING and refuses new requests, withdraws the registration
    (its lease is revoked), lets in-flight calls finish within ``drain_timeout_s``,
    then stops."""
    registrar = registrar or NullRegistrar()
    backend = engine_host(config, worker_id, metrics.endpoint if metrics else "")
    worker = await start_worker_server(backend, host, port, keepalive_s,
                                       secret=config.connector.cluster_secret(), tls=tls)
    metrics_server = start_worker_metrics(metrics, backend, worker.state) if metrics else None
    bound = worker.port
    logger.info("%s worker %s: gRPC on %s:%d, loading engine", config.role, worker_id, host, bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        load = asyncio.ensure_future(asyncio.to_thread(backend.start))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            load.result()  # raises if the engine failed to start
            await backend.start_loras()  # raises if a --lora-modules folder is bad
            backend.start_mirroring(loop)
            await worker.state.update()  # SERVING
            logger.info("%s worker %s ready (KV %s on port %d)", config.role, worker_id,
                        config.connector.transport, config.connector.kv_port)
            announce = functools.partial(worker_info, backend, advertise_host or host, bound)
            await registrar.start(announce())

            async def reannounce() -> None:  # after a role switch (POST .../role)
                await registrar.update(announce())

            worker.state.on_role_changed = reannounce
            await stopped
    finally:
        logger.info("%s worker %s draining (up to %.0f s)", config.role, worker_id,
                    drain_timeout_s)
        await worker.drain(drain_timeout_s, registrar.close)
        backend.shutdown()
        if metrics_server is not None:  # off the loop: a scrape in progress waits on it
            await asyncio.to_thread(metrics_server.close)
