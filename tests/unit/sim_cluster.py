"""The cache-aware test bench shared by ``test_cache_aware_dispatch.py`` and
``test_decode_cache.py``: simulated workers over real gRPC (their prefix caches emit
KV events through the same relay as vLLM workers), a pool, the router's prefix index
fed from every worker's events as ``build_router`` feeds it, and a ``PDDispatcher``
with ``cache_aware`` placement."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from pdserve_testing import wait_until_async
from prometheus_client import CollectorRegistry

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.types import Role
from pdserve.launch.sim_worker import start_sim_host
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import create_placement
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.kv_feed import KvIndexFeeder
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.weight_board import WeightBoard
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.worker.servicer import start_worker_server
from pdserve.worker.sim.engine import SimConfig, SimEngine


async def start_sim_worker(config: SimConfig, host: str = "127.0.0.1", port: int = 0,
                           secret: ClusterSecret | None = None, tls: GrpcTls | None = None
                           ) -> tuple[grpc.aio.Server, int, SimEngine]:
    """Start a simulated worker on this event loop; returns (server, bound port, engine).
    With the cluster ``secret``, calls without its token are refused; ``tls``: TLS only."""
    backend = start_sim_host(config)
    worker = await start_worker_server(backend, host, port, secret=secret, tls=tls)
    assert isinstance(backend.engine, SimEngine)
    return worker.server, worker.port, backend.engine


@dataclass
class SimCluster:
    dispatcher: PDDispatcher
    engines: dict[str, Any]  # worker id -> its SimEngine
    index: PrefixIndex
    registry: CollectorRegistry
    pool: WorkerPool | None = None  # the dispatcher's (None: a subclass that did not keep it)
    servers: list[Any] = field(default_factory=list)  # the workers' gRPC servers, in order


@contextlib.asynccontextmanager
async def sim_cluster(workers: Sequence[tuple[str, Role]], disagg: DisaggConfig,
                      weight_board: WeightBoard | None = None,
                      **sim: Any) -> AsyncIterator[SimCluster]:
    """``workers``: (id, role) each; ``sim``: the ``SimConfig`` fields they share;
    ``weight_board``: the router's (one of several processes). Yields once the index has
    resynced from every worker."""
    servers, engines = [], {}
    endpoints: dict[str, list[str]] = {"prefill": [], "decode": []}
    for wid, role in workers:
        server, port, engine = await start_sim_worker(SimConfig(role, wid, **sim))
        servers.append(server)
        engines[wid] = engine
        endpoints[role].append(f"127.0.0.1:{port}")
    pool = WorkerPool(endpoints["prefill"], endpoints["decode"], interval_s=0.2)
    index, registry = PrefixIndex(), CollectorRegistry()
    feeder = KvIndexFeeder(lambda: [*pool.prefill, *pool.decode], index, registry)
    dispatcher = PDDispatcher(pool, create_placement("cache_aware"), registry, 10.0,
                              PrefixRouting(index, registry), disagg,
                              weight_board=weight_board)
    await pool.start()
    await feeder.start()
    try:
        assert await wait_until_async(lambda: sum(f.num_resyncs for f in feeder.followers)
                                      == len(workers), 5)
        yield SimCluster(dispatcher, engines, index, registry, pool, servers)
    finally:
        await feeder.close()
        await pool.close()
        for s in servers:
            await s.stop(0)
