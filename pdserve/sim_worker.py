"""The simulated worker: the same gRPC ``WorkerService`` over a ``SimEngine``.

``pdserve sim-worker --role prefill --port 50051`` (or ``python -m
pdserve.sim_worker``). Tokens are made up; timing, prefix caching and KV events
are modelled. For router-scale tests and benchmarks only.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import grpc

from pdserve.kv_relay import kv_snapshot, stream_kv_events
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.sim_engine import SimConfig, SimEngine

logger = logging.getLogger("pdserve.sim_worker")
_ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}
_PHASES = {pb.PHASE_PREFILL: "prefill", pb.PHASE_DECODE: "decode"}


class SimWorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, engine: SimEngine) -> None:
        self.engine = engine
        self._inflight: set[str] = set()

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        cfg = self.engine.config
        if _PHASES.get(request.phase) != cfg.role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"this is a {cfg.role} worker")
        if not request.prompt_token_ids or request.sampling.max_tokens < 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "prompt_token_ids and max_tokens >= 1 are required")
        prompt = list(request.prompt_token_ids)
        self._inflight.add(request.request_id)
        try:
            if cfg.role == "prefill":
                yield await self._prefill(request, prompt)
                return
            tokens = [t async for t in self.engine.decode(prompt, request.sampling.max_tokens)]
            for t in tokens[:-1]:
                yield pb.GenerateResponse(token_ids=[t])
            yield pb.GenerateResponse(token_ids=tokens[-1:], finish_reason=pb.FINISH_REASON_LENGTH,
                                      num_prompt_tokens=len(prompt))
        finally:
            self._inflight.discard(request.request_id)

    async def _prefill(self, request: pb.GenerateRequest, prompt: list[int]
                       ) -> pb.GenerateResponse:
        cached = await self.engine.prefill(prompt)
        resp = pb.GenerateResponse(token_ids=[10 + sum(prompt) % 1000],
                                   finish_reason=pb.FINISH_REASON_LENGTH,
                                   num_cached_tokens=cached, num_prompt_tokens=len(prompt))
        if request.sampling.max_tokens > 1:
            resp.kv_handle.CopyFrom(pb.KvHandle(
                engine_id=self.engine.config.worker_id, remote_request_id=request.request_id,
                num_tokens=len(prompt), transport="sim", transfer_id=request.request_id))
        return resp

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.AbortResponse(found=request.request_id in self._inflight)

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        cfg = self.engine.config
        return pb.HealthResponse(
            ready=True, role=_ROLES[cfg.role], worker_id=cfg.worker_id, model="sim",
            dtype="sim", block_size=cfg.block_size, max_model_len=cfg.max_model_len,
            transport="sim", compatibility_hash=f"sim-{cfg.block_size}")

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        c = self.engine.counters
        return pb.GetLoadResponse(
            num_running_reqs=c.num_running_reqs, num_waiting_reqs=c.num_waiting_reqs,
            kv_cache_usage=self.engine.kv_cache_usage,
            prompt_tokens_computed=c.prompt_tokens_computed,
            prompt_tokens_local_cache_hit=c.prompt_tokens_local_cache_hit,
            num_inflight_reqs=len(self._inflight), num_cached_blocks=len(self.engine.mirror))

    async def StreamKvEvents(self, request: pb.KvEventsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext):
        mirror = self.engine.mirror if self.engine.config.role == "prefill" else None
        async for batch in stream_kv_events(mirror, context):
            yield batch

    async def GetKvSnapshot(self, request: pb.KvSnapshotRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext):
        mirror = self.engine.mirror if self.engine.config.role == "prefill" else None
        return await kv_snapshot(mirror, self.engine.config.worker_id, context)


async def start_sim_worker(config: SimConfig, host: str = "127.0.0.1", port: int = 0
                           ) -> tuple[grpc.aio.Server, int, SimEngine]:
    """Start a simulated worker on this event loop; returns (server, bound port, engine)."""
    engine = SimEngine(config)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_WorkerServiceServicer_to_server(SimWorkerServicer(engine), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    return server, bound, engine


async def serve_sim_worker(config: SimConfig, host: str, port: int) -> None:
    server, bound, _ = await start_sim_worker(config, host, port)
    logger.info("simulated %s worker %s on %s:%d", config.role, config.worker_id, host, bound)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(1.0)


if __name__ == "__main__":
    from pdserve.cli import main

    sys.exit(main(["sim-worker", *sys.argv[1:]]))
