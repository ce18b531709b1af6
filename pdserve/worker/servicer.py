"""gRPC ``WorkerService``: a thin adapter in front of a ``WorkerBackend`` (the engine
host over vLLM or the simulated engine, the router tests' scripted worker).

Every call is ``from_pb -> backend -> to_pb`` through ``pdserve.proto.convert``;
exceptions map to gRPC status in one place (``status_of``). The same server carries
the standard ``grpc.health.v1`` service; ``ServingState`` (``lifecycle.py``) decides
what both health answers say and whether a ``Generate`` is admitted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, replace
from typing import TypeVar

import grpc
from grpc_health.v1 import health_pb2_grpc

from pdserve.core.cluster_secret import ClusterSecret, warn_if_open
from pdserve.core.grpc_auth import server_interceptors
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S, server_options
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.lora import LoraAdapter
from pdserve.core.types import PhaseRequest, WorkerHealth
from pdserve.proto import convert
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.proto.weight_calls import weight_call_from_pb
from pdserve.worker.backend import ErrorKind, WorkerBackend, WorkerError
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.kv.relay import kv_changes, kv_snapshot
from pdserve.worker.lifecycle import ServingState
from pdserve.worker.session import RequestFailed, WorkerSession

logger = logging.getLogger("pdserve.worker")
# After a drain: what is still running is cancelled (and so aborted) this soon.
_STOP_GRACE_S = 1.0
T = TypeVar("T")

STATUS_OF_KIND: dict[ErrorKind, grpc.StatusCode] = {
    "invalid_argument": grpc.StatusCode.INVALID_ARGUMENT,
    "failed_precondition": grpc.StatusCode.FAILED_PRECONDITION,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "unimplemented": grpc.StatusCode.UNIMPLEMENTED,
    "internal": grpc.StatusCode.INTERNAL,
    # Not this worker: the caller runs the request elsewhere (a LoRA adapter's folder).
    "aborted": grpc.StatusCode.ABORTED,
}


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, backend: WorkerBackend, state: ServingState | None = None) -> None:
        self._backend = backend
        self._state = state or ServingState(backend)

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        try:
            outputs = self._outputs(request, context.time_remaining())
            async with contextlib.aclosing(outputs):
                async for response in outputs:
                    yield response
        except RequestFailed as exc:
            await context.abort(exc.code, exc.details)

    async def Session(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.SessionBatch]:
        try:
            async for batch in WorkerSession(self._outputs).serve(request_iterator):
                yield batch
        except RequestFailed as exc:  # the router broke the protocol: the call fails
            await context.abort(exc.code, exc.details)

    async def _outputs(self, request: pb.GenerateRequest, timeout_s: float | None
                       ) -> AsyncGenerator[pb.GenerateResponse, None]:
        """One request's responses, for ``Generate`` and ``Session`` alike; a failure is
        a ``RequestFailed`` with its status. Cancelling (the router cancelled the call,
        or its deadline passed) closes the backend's outputs: that aborts the request
        and frees its KV."""
        try:
            with self._state.admission.call():
                phase = replace(admit(request, self._backend.health()), timeout_s=timeout_s)
                outputs = self._backend.generate(phase)
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        yield convert.phase_output_to_pb(out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status for the router
            if isinstance(exc, ValueError):  # the request's fault (the engine refused it)
                logger.warning("request %s refused: %s", request.request_id, exc)
            elif not isinstance(exc, WorkerError):
                logger.exception("request %s failed", request.request_id)
            raise RequestFailed(*status_of(exc)) from exc

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        return pb.AbortResponse(found=await self._backend.abort(request.request_id))

    async def Health(  # noqa: N802 - gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        health = self._backend.health()
        if self._state.closed:  # the router's health loop stops placing here
            health = replace(health, ready=False)
        reply = convert.health_to_pb(health)
        reply.session = True  # this servicer has Session
        return reply

    async def SetRole(  # noqa: N802 - gRPC method name
        self, request: pb.SetRoleRequest, context: grpc.aio.ServicerContext
    ) -> pb.SetRoleResponse:
        try:
            role, drain_timeout_s = convert.set_role_from_pb(request)
            switch = await self._state.switch_role(role, drain_timeout_s)
        except Exception as exc:  # noqa: BLE001 - mapped to a status for the router
            if not isinstance(exc, (WorkerError, ValueError)):
                logger.exception("role switch to %s failed", request.role)
            await context.abort(*status_of(exc))
            raise  # abort raises; this says so to the reader and the type checker
        return convert.role_switch_to_pb(switch)

    async def LoadLoraAdapter(  # noqa: N802 - gRPC method name
        self, request: pb.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.LoadLoraAdapterResponse:
        try:
            adapter = LoraAdapter(request.lora_name, request.lora_path)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            raise  # abort raises; this says so to the reader and the type checker
        changed = await self._answer(context, "load LoRA", self._backend.load_lora(adapter))
        return pb.LoadLoraAdapterResponse(changed=changed)

    async def UnloadLoraAdapter(  # noqa: N802 - gRPC method name
        self, request: pb.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> pb.UnloadLoraAdapterResponse:
        unloaded = await self._answer(context, "unload LoRA",
                                      self._backend.unload_lora(request.lora_name))
        return pb.UnloadLoraAdapterResponse(unloaded=unloaded)

    async def StageWeights(  # noqa: N802 - gRPC method name
        self, request: pb.StageWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.StageWeightsResponse:
        staged = await self._answer(context, "stage weights", self._backend.stage_weights(
            request.model_path, request.weight_version))
        return pb.StageWeightsResponse(**asdict(staged))

    async def CommitWeights(  # noqa: N802 - gRPC method name
        self, request: pb.CommitWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitWeightsResponse:
        done = await self._answer(context, "commit weights", self._state.commit_weights(
            request.weight_version, request.abort, request.drain_timeout_ns / 1e9))
        return pb.CommitWeightsResponse(**asdict(done))

    async def DiscardWeights(  # noqa: N802 - gRPC method name
        self, request: pb.DiscardWeightsRequest, context: grpc.aio.ServicerContext
    ) -> pb.DiscardWeightsResponse:
        discarded = await self._answer(context, "discard weights",
                                       self._backend.discard_weights())
        return pb.DiscardWeightsResponse(discarded=discarded)

    async def EngineWeightCall(  # noqa: N802 - gRPC method name
        self, request: pb.EngineWeightCallRequest, context: grpc.aio.ServicerContext
    ) -> pb.EngineWeightCallResponse:
        try:
            call = weight_call_from_pb(request)
        except ValueError as exc:  # no call, or one this worker's schema does not know
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        version = await self._answer(context, call.name, self._backend.engine_weight_call(call))
        return pb.EngineWeightCallResponse(weight_version=version)

    async def _answer(self, context: grpc.aio.ServicerContext, what: str,
                      call: Awaitable[T]) -> T:
        """``call``'s result; its error as the call's status (logged when unexpected)."""
        try:
            return await call
        except Exception as exc:  # noqa: BLE001 - mapped to a status for the router
            if not isinstance(exc, (WorkerError, ValueError)):
                logger.exception("%s failed", what)
            await context.abort(*status_of(exc))
            raise  # abort raises; this says so to the reader and the type checker

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


@dataclass
class WorkerServer:
    """A started worker server: its gRPC server, bound port and serving state."""

    server: grpc.aio.Server
    port: int
    state: ServingState

    async def drain(self, timeout_s: float,
                    withdraw: Callable[[], Awaitable[None]] | None = None) -> bool:
        """Stop taking requests (and ``withdraw``: leave membership), let those in
        flight finish within ``timeout_s`` in all, then stop the server, which cancels
        (and so aborts) whatever is left. Whether everything finished."""
        deadline = time.monotonic() + timeout_s
        await self.state.start_drain()
        if withdraw is not None:
            await withdraw()
        idle = await self.state.wait_idle(max(deadline - time.monotonic(), 0.0))
        await self.server.stop(_STOP_GRACE_S)
        return idle


async def start_worker_server(backend: WorkerBackend, host: str = "127.0.0.1", port: int = 0,
                              keepalive_s: float = DEFAULT_KEEPALIVE_S, *,
                              secret: ClusterSecret | None = None,
                              tls: GrpcTls | None = None) -> WorkerServer:
    """Serve ``backend`` and the standard health service on ``host:port`` (0: any free
    port). Health says SERVING at once if the backend is ready; else call
    ``state.update()`` once it is. With the cluster ``secret``, calls without a fresh
    proof for this worker are refused and answers prove the secret (``grpc_auth``; the
    standard health service stays open); with ``tls``, only TLS is served (``grpc_tls``)."""
    warn_if_open("worker gRPC", host, secret)
    server = grpc.aio.server(options=server_options(keepalive_s),
                             interceptors=server_interceptors(secret, backend.health().worker_id))
    state = ServingState(backend)
    pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(backend, state), server)
    health_pb2_grpc.add_HealthServicer_to_server(state.health, server)
    address = f"{host}:{port}"
    bound = (server.add_insecure_port(address) if tls is None
             else server.add_secure_port(address, tls.server_credentials()))
    if bound == 0:
        raise RuntimeError(f"cannot bind gRPC port {host}:{port}")
    await state.update()
    await server.start()
    return WorkerServer(server, bound, state)

