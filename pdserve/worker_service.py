"""gRPC ``WorkerService``: a thin adapter between protobuf and ``EngineHost``.

Exceptions map to gRPC status in one place (``_status_of``).
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pdserve.engine_host import EngineHost, PhaseOutput
from pdserve.kv_relay import kv_snapshot, stream_kv_events
from pdserve.kv_transfer.metadata import KVHandle, PushTarget
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.types import SamplingSpec

logger = logging.getLogger("pdserve.worker")

_PHASES = {pb.PHASE_PREFILL: "prefill", pb.PHASE_DECODE: "decode"}
_ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}
_FINISH = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}


def handle_to_pb(h: KVHandle) -> pb.KvHandle:
    return pb.KvHandle(
        engine_id=h.engine_id, remote_request_id=h.remote_request_id, block_ids=h.block_ids,
        num_tokens=h.num_tokens, transport=h.transport, host=h.host, port=h.port,
        transfer_id=h.transfer_id, lease_deadline_unix_ns=h.lease_deadline_unix_ns,
        pushed=h.pushed,
    )


def handle_from_pb(h: pb.KvHandle) -> KVHandle:
    return KVHandle(
        engine_id=h.engine_id, remote_request_id=h.remote_request_id,
        block_ids=tuple(h.block_ids), num_tokens=h.num_tokens, transport=h.transport,
        host=h.host, port=h.port, transfer_id=h.transfer_id,
        lease_deadline_unix_ns=h.lease_deadline_unix_ns, pushed=h.pushed,
    )


def sampling_from_pb(s: pb.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
        top_k=max(s.top_k, 0), seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
    )


def _to_pb(out: PhaseOutput) -> pb.GenerateResponse:
    resp = pb.GenerateResponse(
        token_ids=out.token_ids, finish_reason=_FINISH[out.finish_reason],
        num_cached_tokens=out.num_cached_tokens, num_prompt_tokens=out.num_prompt_tokens,
    )
    if out.kv_handle is not None:
        resp.kv_handle.CopyFrom(handle_to_pb(out.kv_handle))
    return resp


class WorkerServicer(pb_grpc.WorkerServiceServicer):
    def __init__(self, host: EngineHost) -> None:
        self._host = host

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        phase = _PHASES.get(request.phase)
        problem = _validate(request, phase, self._host)
        if problem:
            await context.abort(*problem)
        assert phase is not None
        handle = handle_from_pb(request.kv_handle) if request.HasField("kv_handle") else None
        push = None
        if request.HasField("kv_push_target"):
            t = request.kv_push_target
            push = PushTarget(t.host, t.port, t.transfer_id)
        try:
            async for out in self._host.generate(
                request.request_id, phase, list(request.prompt_token_ids),
                sampling_from_pb(request.sampling), handle, push,
            ):
                yield _to_pb(out)
        except asyncio.CancelledError:
            # The router cancelled the call; vLLM aborted the request on our way out.
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status for the router
            logger.exception("request %s failed", request.request_id)
            await context.abort(*_status_of(exc))

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        return pb.AbortResponse(found=await self._host.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        ident = self._host.identity()
        cfg = self._host.config
        return pb.HealthResponse(
            ready=self._host.ready, role=_ROLES[cfg.role], worker_id=self._host.worker_id,
            model=cfg.served_model_name, dtype=ident["dtype"], block_size=ident["block_size"],
            max_model_len=cfg.max_model_len, transport=cfg.connector.transport,
            compatibility_hash=ident["compatibility_hash"],
            kv_host=cfg.connector.kv_host, kv_port=cfg.connector.kv_port,
            kv_push=self._host.kv_push,
        )

    async def GetLoad(self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext):  # noqa: N802
        self._host.prune_leases()
        status = await asyncio.to_thread(self._host.kv_status) if self._host.ready else {}
        c = self._host.counters
        with c.lock:
            return pb.GetLoadResponse(
                num_running_reqs=c.num_running_reqs, num_waiting_reqs=c.num_waiting_reqs,
                kv_cache_usage=c.kv_cache_usage,
                num_pending_transfers=int(status.get("num_leases", 0))
                + int(status.get("inflight_pulls", 0)),
                prompt_tokens_computed=c.prompt_tokens_computed,
                prompt_tokens_local_cache_hit=c.prompt_tokens_local_cache_hit,
                prompt_tokens_external=c.prompt_tokens_external,
                kv_bytes_sent=int(status.get("bytes_sent", 0)),
                kv_bytes_received=int(status.get("bytes_received", 0)),
                kv_transfers_completed=int(status.get("transfers_completed", 0)),
                kv_transfers_failed=int(status.get("transfers_failed", 0)),
                kv_transfer_time_ns=int(status.get("transfer_time_ns", 0)),
                num_inflight_reqs=self._host.num_inflight,
                kv_leases_expired=int(status.get("leases_expired", 0)),
                kv_loads=int(status.get("loads", 0)),
                kv_load_time_ns=int(status.get("load_time_ns", 0)),
                kv_push_loads=int(status.get("push_loads", 0)),
                kv_push_fallbacks=int(status.get("push_fallbacks", 0)),
                kv_layers_pushed=int(status.get("layers_pushed", 0)),
                kv_pushes_failed=int(status.get("pushes_failed", 0)),
                num_cached_blocks=len(self._host.kv_mirror or ()),
            )

    async def StreamKvEvents(self, request: pb.KvEventsRequest,  # noqa: N802
                             context: grpc.aio.ServicerContext):
        if self._host.config.kv_events is not None and self._host.kv_mirror is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        async for batch in stream_kv_events(self._host.kv_mirror, context):
            yield batch

    async def GetKvSnapshot(self, request: pb.KvSnapshotRequest,  # noqa: N802
                            context: grpc.aio.ServicerContext):
        if self._host.config.kv_events is not None and self._host.kv_mirror is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is loading")
        return await kv_snapshot(self._host.kv_mirror, self._host.worker_id, context)


def _validate(
    request: pb.GenerateRequest, phase: str | None, host: EngineHost
) -> tuple[grpc.StatusCode, str] | None:
    if not host.ready:
        return grpc.StatusCode.UNAVAILABLE, "engine is loading"
    if phase is None:
        return grpc.StatusCode.INVALID_ARGUMENT, "phase must be PHASE_PREFILL or PHASE_DECODE"
    if phase != host.config.role:
        return grpc.StatusCode.FAILED_PRECONDITION, f"this is a {host.config.role} worker"
    if not request.request_id or not request.prompt_token_ids:
        return grpc.StatusCode.INVALID_ARGUMENT, "request_id and prompt_token_ids are required"
    if request.sampling.max_tokens < 1:
        return grpc.StatusCode.INVALID_ARGUMENT, "sampling.max_tokens must be >= 1"
    total = len(request.prompt_token_ids) + (
        1 if phase == "prefill" else request.sampling.max_tokens)
    if total > host.config.max_model_len:
        return grpc.StatusCode.INVALID_ARGUMENT, (
            f"{total} tokens exceed max_model_len {host.config.max_model_len}")
    return None


def _status_of(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"
