"""gRPC ``WorkerService``: a thin adapter in front of a ``WorkerBackend`` (the
vLLM engine host, the simulator, the router tests' scripted worker).

Every call is ``from_pb -> backend -> to_pb`` through ``pdserve.proto.convert``;
exceptions map to gRPC status in one place (``status_of``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from pdserve.cluster_secret import ClusterSecret, warn_if_open
from pdserve.grpc_auth import server_interceptors
from pdserve.grpc_tls import GrpcTls
from pdserve.prefill_worker.kv_mirror import KvCacheMirror
from pdserve.prefill_worker.kv_relay import kv_changes, kv_snapshot
from pdserve.proto import convert
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.types import PhaseRequest, WorkerHealth
from pdserve.worker.backend import ErrorKind, WorkerBackend, WorkerError

logger = logging.getLogger("pdserve.worker")

STATUS_OF_KIND: dict[ErrorKind, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "unimplemented": grpc.StatusCode.UNIMPLEMENTED,
    "internal": grpc.StatusCode.INTERNAL,
}


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, backend: WorkerBackend) -> None:
        self._backend = backend

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            outputs = self._backend.generate(admit(request, self._backend.health()))
            async with contextlib.aclosing(outputs):
                async for out in outputs:
                    yield convert.phase_output_to_pb(out)
        except asyncio.CancelledError:
            # The router cancelled the call; closing the outputs aborted the request.
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status for the router
            if not isinstance(exc, WorkerError):
                logger.exception("request %s failed", request.request_id)
            await context.abort(*status_of(exc))

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self._backend.abort(request.request_id))

    async def Health(  # noqa: N802 - gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return convert.health_to_pb(self._backend.health())

    async def GetLoad(  # noqa: N802 - gRPC method name
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        return convert.load_to_pb(await self._backend.load())

    async def StreamKvEvents(  # noqa: N802 - gRPC method name
        self, request: pb.KvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.KvEventBatch]:
        changes = kv_changes(await self._mirror(context))
        async with contextlib.aclosing(changes):
            async for change in changes:
                yield convert.kv_change_to_pb(change)

    async def GetKvSnapshot(  # noqa: N802 - gRPC method name
        self, request: pb.KvSnapshotRequest, context: grpc.aio.ServicerContext
    ) -> pb.KvSnapshot:
        mirror = await self._mirror(context)
        return convert.kv_snapshot_to_pb(kv_snapshot(mirror, self._backend.health().worker_id))

    async def _mirror(self, context: grpc.aio.ServicerContext) -> KvCacheMirror:
        try:
            mirror = self._backend.kv_mirror()
        except WorkerError as exc:
            await context.abort(*status_of(exc))
            raise  # abort raises; this says so to the reader and the type checker
        if mirror is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                                "this worker publishes no KV events")
        return mirror


def admit(request: pb.GenerateRequest, health: WorkerHealth) -> PhaseRequest:
    """The request as pdserve types, if this worker can serve it; else raises."""
    if not health.ready:
        raise WorkerError("unavailable", "engine is loading")
    try:
        req = convert.phase_request_from_pb(request)
    except ValueError as exc:
        raise WorkerError("invalid_argument", str(exc)) from None
    if req.phase != health.role:
        raise WorkerError("failed_precondition", f"this is a {health.role} worker")
    if not req.request_id or not req.prompt_token_ids:
        raise WorkerError("invalid_argument", "request_id and prompt_token_ids are required")
    if req.sampling.max_tokens < 1:
        raise WorkerError("invalid_argument", "sampling.max_tokens must be >= 1")
    total = len(req.prompt_token_ids) + (1 if req.phase == "prefill" else req.sampling.max_tokens)
    if total > health.max_model_len:
        raise WorkerError("invalid_argument",
                          f"{total} tokens exceed max_model_len {health.max_model_len}")
    return req


def status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, WorkerError):
        return STATUS_OF_KIND[exc.kind], str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


async def start_server(backend: WorkerBackend, host: str = "127.0.0.1", port: int = 0, *,
                       secret: ClusterSecret | None = None, tls: GrpcTls | None = None
                       ) -> tuple[grpc.aio.Server, int]:
    """Serve ``backend`` on ``host:port`` (0: any free port); returns (server, bound port).
    With the cluster ``secret``, calls without its token are refused (``grpc_auth``);
    with ``tls``, only TLS is served (``grpc_tls``)."""
    warn_if_open("worker gRPC", host, secret)
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)],
                             interceptors=server_interceptors(secret))
    pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(backend), server)
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if tls is None
             else server.add_secure_port(address, tls.server_credentials()))
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await server.start()
    return server, bound
