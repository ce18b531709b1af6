"""The simulated worker: ``EngineHost`` over a ``SimEngine``, behind the same gRPC
``WorkerService`` (``pdserve.worker.servicer``) and with the same role policies
(``pdserve.roles``) a vLLM worker runs.

``pdserve sim-worker --role prefill --port 50051`` (its config is built by
``pdserve.cli.configs.sim_config``). Tokens are made up; timing, prefix caching and KV events
are modelled. Its weights change in place as a vLLM worker's do, with the same rules
(``pdserve.worker.weights``): a call's tokens come from one version, and KV crosses
workers only within one. For router-scale tests and benchmarks only.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.handle import KVHandle
from pdserve.core.types import Role
from pdserve.membership import Registrar, WorkerInfo
from pdserve.membership.static import NullRegistrar
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.worker.engine import EngineConfig, EngineCounters
from pdserve.worker.host import EngineHost
from pdserve.worker.metrics import MetricsListener, start_worker_metrics
from pdserve.worker.policy import RolePolicy
from pdserve.worker.servicer import WorkerServer, start_worker_server
from pdserve.worker.sim.engine import SimConfig, SimEngine

logger = logging.getLogger("pdserve.sim_worker")


def _nothing_to_release(handle: KVHandle) -> None:
    """A simulated prefill keeps no blocks for its decode (no KV moves): nothing to free."""
    return None


def sim_role_policy(role: Role) -> RolePolicy:
    """``role``'s policy on a simulated worker: the real one, with no KV to release."""
    if role == "prefill":
        return PrefillPolicy(release=_nothing_to_release)
    return DecodePolicy()


def sim_host(config: SimConfig, metrics_endpoint: str = "") -> EngineHost:
    """The simulated worker's host, its engine started (at once: nothing loads). Serve it
    after ``start_mirroring`` on the server's event loop (``start_sim_host``)."""

    def engine(engine_config: EngineConfig, counters: EngineCounters) -> SimEngine:
        return SimEngine(config, counters)

    host = EngineHost(config.engine_config, config.worker_id, sim_role_policy(config.role),
                      engine, metrics_endpoint=metrics_endpoint, policy_for=sim_role_policy)
    host.start()
    return host


def start_sim_host(config: SimConfig, metrics_endpoint: str = "") -> EngineHost:
    """``sim_host``, its KV events mirrored on the running event loop (call on it)."""
    host = sim_host(config, metrics_endpoint)
    host.start_mirroring(asyncio.get_running_loop())
    return host


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
    backend = start_sim_host(config, metrics.endpoint if metrics else "")
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
        backend.shutdown()
        if metrics_server is not None:  # off the loop: a scrape in progress waits on it
            await asyncio.to_thread(metrics_server.close)


def sim_worker_info(host_backend: EngineHost, host: str, port: int) -> WorkerInfo:
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
