"""Runs one worker process: the gRPC WorkerService in front of an in-process
vLLM engine. Health answers "not ready" while the engine loads."""

from __future__ import annotations

import asyncio
import logging
import signal

import grpc

from pdserve.engine import EngineConfig
from pdserve.engine_host import EngineHost
from pdserve.membership import Registrar, WorkerInfo
from pdserve.membership.static import NullRegistrar
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.worker_service import WorkerServicer

logger = logging.getLogger("pdserve.worker")
_GRACE_S = 5.0


def worker_info(host: EngineHost, advertise_host: str, grpc_port: int) -> WorkerInfo:
    """What this worker registers (DESIGN.md "Membership"), once its engine is ready."""
    ident = host.identity()
    cfg = host.config
    capacity: dict[str, float] = {"kv_cache_gib": cfg.kv_cache_gib,
                                  "max_num_seqs": cfg.max_num_seqs}
    if host.engine is not None:
        capacity["num_kv_blocks"] = host.engine.vllm_config.cache_config.num_gpu_blocks or 0
    conn = cfg.connector
    return WorkerInfo(
        worker_id=host.worker_id, role=cfg.role, grpc_endpoint=f"{advertise_host}:{grpc_port}",
        kv_endpoints={conn.transport: f"{conn.kv_host}:{conn.kv_port}"},
        model=cfg.served_model_name, dtype=ident["dtype"], block_size=ident["block_size"],
        compatibility_hash=ident["compatibility_hash"], max_model_len=cfg.max_model_len,
        capacity=capacity,
    )


async def serve_worker(config: EngineConfig, worker_id: str, host: str, port: int,
                       registrar: Registrar | None = None,
                       advertise_host: str | None = None) -> None:
    """Serve until SIGTERM/SIGINT. Registers with ``registrar`` once the engine is
    ready; on the way out withdraws the registration first (no new requests), then
    lets in-flight calls finish."""
    registrar = registrar or NullRegistrar()
    engine_host = EngineHost(config, worker_id)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(engine_host), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    logger.info("%s worker %s: gRPC on %s:%d, loading engine", config.role, worker_id, host, bound)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        load = asyncio.ensure_future(asyncio.to_thread(engine_host.start))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([load, stopped], return_when=asyncio.FIRST_COMPLETED)
        if load.done():
            load.result()  # raises if the engine failed to start
            engine_host.start_kv_events(loop)
            logger.info("%s worker %s ready (KV %s on port %d)", config.role, worker_id,
                        config.connector.transport, config.connector.kv_port)
            await registrar.start(worker_info(engine_host, advertise_host or host, bound))
            await stopped
    finally:
        logger.info("%s worker %s stopping", config.role, worker_id)
        await registrar.close()
        await server.stop(_GRACE_S)
        engine_host.shutdown()
