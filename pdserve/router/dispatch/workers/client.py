"""The router's one gRPC adapter to a worker: a channel and its stub, speaking
pdserve's own types (``pdserve.core.types``) in and out. Protobuf is converted in
``pdserve.proto.convert``; nothing above this module sees a message or a grpc
exception.

Every failed call raises ``WorkerCallError`` carrying the gRPC status code's
name (``"UNAVAILABLE"``, ``"INVALID_ARGUMENT"``, ``"UNIMPLEMENTED"``, ...), which
is all the dispatcher needs to choose between fallback, retry and failure.
Streams (``generate``, ``kv_events``) cancel their call when closed: callers
close them (``contextlib.aclosing``) as soon as they stop reading.

``probe_health`` / ``probe_load`` are blocking one-shot calls for tools (the
launcher, tests, benchmarks).

With the cluster secret every call is signed for this worker and its answer must prove
the secret before it is used (``pdserve.core.grpc_auth``); one that does not fails
UNAUTHENTICATED, counted. A refusal that names another worker id (the id was not known,
or the worker behind the endpoint changed) is retried once, signed for that id.

Channels are made in one place (``open_channel``, ``_probe``) with the options of
``pdserve.core.grpc_options``: keepalive pings turn a hung worker into UNAVAILABLE within
seconds, whatever the calls' deadlines.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import grpc

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_auth import CallAuth, aio_channel, refused_for, sync_channel
from pdserve.core.grpc_options import DEFAULT_KEEPALIVE_S, client_options
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.lora import LoraAdapter
from pdserve.core.types import (
    KvChange,
    KvSnapshot,
    PhaseOutput,
    PhaseRequest,
    Role,
    RoleSwitch,
    WeightsCommitted,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.core.weight_calls import WeightCall
from pdserve.proto import convert
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.proto.weight_calls import weight_call_to_pb
from pdserve.router.dispatch.workers.session import (
    SESSION_IDLE_S,
    RouterSession,
    SessionCallError,
    code_name,
)

logger = logging.getLogger("pdserve.router.dispatch")

UNAVAILABLE = "UNAVAILABLE"
INVALID_ARGUMENT = "INVALID_ARGUMENT"
UNIMPLEMENTED = "UNIMPLEMENTED"
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
CANCELLED = "CANCELLED"
ABORTED = "ABORTED"  # pdserve's workers: a LoRA adapter served from another folder
UNAUTHENTICATED = "UNAUTHENTICATED"
_SERVICE = "/" + pb.DESCRIPTOR.services_by_name["WorkerService"].full_name + "/"


class WorkerCallError(RuntimeError):
    """A call to a worker failed; ``code`` is the gRPC status code's name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> WorkerCallError:
        """From an ``AioRpcError`` or a blocking call's error (both are ``grpc.Call``s)."""
        if isinstance(exc, grpc.aio.AioRpcError | grpc.Call):
            return cls(exc.code().name, exc.details() or "")
        return cls("UNKNOWN", str(exc))


class WorkerClient:
    """One worker's gRPC endpoint. Every call but ``kv_events`` takes its deadline in
    seconds (the time the request has left)."""

    def __init__(self, endpoint: str, secret: ClusterSecret | None = None, *,
                 tls: GrpcTls | None = None, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 session_idle_s: float = SESSION_IDLE_S, worker_id: str = "") -> None:
        """``worker_id``: the worker's id when membership knows it (else learnt)."""
        self.endpoint = endpoint
        # Every call is signed with a ``secret`` (``_auth``); TLS with ``tls``.
        self._channel = open_channel(endpoint, keepalive_s, tls)
        self._stub = pb_grpc.WorkerServiceStub(self._channel)
        self._auth = None if secret is None else CallAuth(secret, endpoint, worker_id)
        self._session = RouterSession(self._stub, self._auth, session_idle_s)

    async def generate(self, request: PhaseRequest, timeout_s: float,
                       tap: Callable[[tuple[int, ...]], bool] | None = None
                       ) -> AsyncGenerator[PhaseOutput, None]:
        """The phase's outputs as the worker streams them; closing this cancels the
        request on the worker. Over the worker's ``Session`` (one stream per worker for
        all of this router's requests, ``workers/session.py``); over ``Generate`` for a
        worker without it. The hot path of every streamed token: one deque pop and one
        conversion per output, no further layer. ``tap``: offered the token ids of each
        output that carries nothing else (``convert.plain_token_ids``) and arrives while
        this iterator's reader waits for the next; an output it takes (True) is not
        yielded (``SessionStream.tap``; over ``Session`` only)."""
        if self._auth is not None and not self._auth.audience:
            await self.health(timeout_s)  # once: learn whom to sign the session for
        if self._session.unsupported:
            async for out in self._generate_call(request, timeout_s):
                yield out
            return
        session = self._session
        stream = session.start(convert.phase_request_to_pb(request), timeout_s)
        from_pb = convert.phase_output_from_pb
        stream.tap = tap
        try:
            while True:
                output = await stream.next()
                if output.__class__ is tuple:  # a plain output's token ids
                    yield PhaseOutput(output)
                    continue
                if output.end:
                    break
                yield from_pb(output.response)
        except SessionCallError as exc:
            if session.unsupported:  # an older worker: nothing ran there
                logger.info("worker %s has no Session; using Generate", self.endpoint)
                session.finish(stream)
                async for out in self._generate_call(request, timeout_s):
                    yield out
                return
            raise WorkerCallError(exc.code, exc.details) from exc
        finally:
            session.finish(stream)
        if output.status_code:
            raise WorkerCallError(code_name(output.status_code), output.status_details)

    async def _generate_call(self, request: PhaseRequest, timeout_s: float
                             ) -> AsyncGenerator[PhaseOutput, None]:
        """``generate`` over one ``Generate`` call of its own."""
        md, nonce = self._sign("Generate")
        call = self._stub.Generate(convert.phase_request_to_pb(request), timeout=timeout_s,
                                   metadata=md)
        async for msg in _stream(call, self._auth, _SERVICE + "Generate", nonce):
            yield convert.phase_output_from_pb(msg)

    async def abort(self, request_id: str, timeout_s: float) -> bool:
        """Whether the worker had the request (running, or holding its KV)."""
        reply = await self._unary("Abort", pb.AbortRequest(request_id=request_id),
                                  timeout_s)
        return reply.found

    async def health(self, timeout_s: float) -> WorkerHealth:
        """Raises ``ValueError`` if the worker names no known role. A worker that does not
        say it serves ``Session`` (an older one) is called over ``Generate`` from then on
        (the pool checks health before it places anything on a worker)."""
        reply = await self._unary("Health", pb.HealthRequest(), timeout_s)
        self._session.unsupported = not reply.session
        return convert.health_from_pb(reply)

    async def load(self, timeout_s: float) -> WorkerLoadReport:
        return convert.load_from_pb(
            await self._unary("GetLoad", pb.GetLoadRequest(), timeout_s))

    async def kv_events(self) -> AsyncGenerator[KvChange, None]:
        """The worker's prefix-cache changes, until it or the caller ends the stream."""
        md, nonce = self._sign("StreamKvEvents")
        call = self._stub.StreamKvEvents(pb.KvEventsRequest(), metadata=md)
        async for msg in _stream(call, self._auth, _SERVICE + "StreamKvEvents", nonce):
            yield convert.kv_change_from_pb(msg)

    async def kv_snapshot(self, timeout_s: float) -> KvSnapshot:
        return convert.kv_snapshot_from_pb(
            await self._unary("GetKvSnapshot", pb.KvSnapshotRequest(), timeout_s))

    async def set_role(self, role: Role, drain_timeout_s: float, timeout_s: float
                       ) -> RoleSwitch:
        """Switch the worker to ``role`` (``SetRole``); ``timeout_s`` must leave room for
        the drain."""
        return convert.role_switch_from_pb(await self._unary(
            "SetRole", convert.set_role_to_pb(role, drain_timeout_s), timeout_s))

    # ---- LoRA adapters ----

    async def load_lora(self, adapter: LoraAdapter, timeout_s: float) -> bool:
        """Serve ``adapter`` on the worker; False: it served it already."""
        reply = await self._unary("LoadLoraAdapter", pb.LoadLoraAdapterRequest(
            lora_name=adapter.name, lora_path=adapter.path), timeout_s)
        return bool(reply.changed)

    async def unload_lora(self, name: str, timeout_s: float) -> bool:
        """False: the worker did not serve it."""
        reply = await self._unary("UnloadLoraAdapter",
                                  pb.UnloadLoraAdapterRequest(lora_name=name), timeout_s)
        return bool(reply.unloaded)

    # ---- weights (the worker's ``StageWeights`` ... ``EngineWeightCall``) ----

    async def stage_weights(self, model_path: str, version: str, timeout_s: float
                            ) -> WeightsStaged:
        return convert.staged_from_pb(await self._unary(
            "StageWeights",
            pb.StageWeightsRequest(model_path=model_path, weight_version=version), timeout_s))

    async def commit_weights(self, version: str, abort: bool, drain_timeout_s: float,
                             timeout_s: float) -> WeightsCommitted:
        """``timeout_s`` must leave room for the drain."""
        return convert.committed_from_pb(await self._unary(
            "CommitWeights", pb.CommitWeightsRequest(
                weight_version=version, abort=abort,
                drain_timeout_ns=int(max(drain_timeout_s, 0.0) * 1e9)), timeout_s))

    async def discard_weights(self, timeout_s: float) -> bool:
        reply = await self._unary("DiscardWeights", pb.DiscardWeightsRequest(),
                                  timeout_s)
        return reply.discarded

    async def engine_weight_call(self, call: WeightCall, timeout_s: float) -> str:
        """One of vLLM's weight-transfer calls; the version the worker serves after it."""
        reply = await self._unary("EngineWeightCall", weight_call_to_pb(call), timeout_s)
        return reply.weight_version

    def _sign(self, name: str) -> tuple[tuple[tuple[str, str], ...], str]:
        return ((), "") if self._auth is None else self._auth.sign(_SERVICE + name)

    async def _unary(self, name: str, request: Any, timeout_s: float) -> Any:
        """One unary call of the stub's method ``name``, signed, its answer's proof checked;
        its failure as a ``WorkerCallError``."""
        method = getattr(self._stub, name)
        for attempt in (0, 1):
            md, nonce = self._sign(name)
            try:
                call = method(request, timeout=timeout_s, metadata=md)
                reply = await call
                if self._auth is not None:
                    reason = self._auth.verify(_SERVICE + name, nonce,
                                               await call.initial_metadata())
                    if reason is not None:
                        raise WorkerCallError(UNAUTHENTICATED, refused_for(self.endpoint, reason))
                return reply
            except grpc.aio.AioRpcError as exc:
                if attempt == 0 and _learnt(self._auth, exc):
                    continue
                raise WorkerCallError.from_rpc(exc) from exc
            except grpc.aio.UsageError as exc:  # the channel was closed (the worker left)
                raise WorkerCallError("UNAVAILABLE", f"channel closed: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def close(self, grace_s: float | None = None) -> None:
        """Close the channel; with ``grace_s`` the calls running on it (the session's
        requests too) get that long to finish first."""
        await self._session.close(grace_s)
        await self._channel.close(grace_s)


def open_channel(endpoint: str, keepalive_s: float = DEFAULT_KEEPALIVE_S,
                 tls: GrpcTls | None = None) -> grpc.aio.Channel:
    """The router's channel to one worker: every option it needs, set here only (TLS
    with ``tls``; the cluster proofs travel per call)."""
    return aio_channel(endpoint, client_options(keepalive_s), tls)


def _learnt(auth: CallAuth | None, exc: grpc.RpcError) -> bool:
    """Whether ``exc`` is a refusal that named another worker id (now signed for)."""
    return (auth is not None and isinstance(exc, grpc.aio.AioRpcError | grpc.Call)
            and exc.code() == grpc.StatusCode.UNAUTHENTICATED
            and auth.learn(exc.trailing_metadata()))


async def _stream(call: Any, auth: CallAuth | None, method: str, nonce: str
                  ) -> AsyncIterator[Any]:
    """A streaming call's messages, once its answer proved the secret (with ``auth``); its
    failure as a ``WorkerCallError``; cancelled when the caller stops reading."""
    try:
        if auth is not None:
            metadata = await call.initial_metadata()
            # A call that failed before answering has no proof to check: iterating raises
            # its status. Anything else (an OK end included) must carry the proof.
            failed = call.done() and not metadata and await call.code() != grpc.StatusCode.OK
            if not failed:
                reason = auth.verify(method, nonce, metadata)
                if reason is not None:
                    raise WorkerCallError(UNAUTHENTICATED, refused_for(auth.peer, reason))
        async for msg in call:
            yield msg
    except grpc.aio.AioRpcError as exc:
        raise WorkerCallError.from_rpc(exc) from exc
    finally:
        call.cancel()


def probe_health(endpoint: str, timeout_s: float, secret: ClusterSecret | None = None,
                 tls: GrpcTls | None = None) -> WorkerHealth:
    """One blocking ``Health`` call; raises ``WorkerCallError`` (or ``ValueError``
    for a worker that names no known role)."""
    return convert.health_from_pb(_probe(endpoint, "Health", pb.HealthRequest(), timeout_s,
                                         secret, tls))


def probe_load(endpoint: str, timeout_s: float, secret: ClusterSecret | None = None,
               tls: GrpcTls | None = None) -> WorkerLoadReport:
    """One blocking ``GetLoad`` call; raises ``WorkerCallError``."""
    return convert.load_from_pb(_probe(endpoint, "GetLoad", pb.GetLoadRequest(), timeout_s,
                                       secret, tls))


def _probe(endpoint: str, name: str, request: Any, timeout_s: float,
           secret: ClusterSecret | None, tls: GrpcTls | None) -> Any:
    """One blocking unary call of the method ``name`` on a channel of its own, signed and
    its answer's proof checked when there is a ``secret``, over TLS with ``tls``."""
    auth = None if secret is None else CallAuth(secret, endpoint)
    with sync_channel(endpoint, tls, client_options()) as channel:
        method = getattr(pb_grpc.WorkerServiceStub(channel), name)
        for attempt in (0, 1):
            md, nonce = ((), "") if auth is None else auth.sign(_SERVICE + name)
            try:
                reply, call = method.with_call(request, timeout=timeout_s, metadata=md)
            except grpc.RpcError as exc:
                if attempt == 0 and _learnt(auth, exc):
                    continue
                raise WorkerCallError.from_rpc(exc) from exc
            if auth is not None:
                reason = auth.verify(_SERVICE + name, nonce, call.initial_metadata())
                if reason is not None:
                    raise WorkerCallError(UNAUTHENTICATED, refused_for(endpoint, reason))
            return reply
    raise AssertionError("unreachable")  # pragma: no cover
