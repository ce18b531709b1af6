"""Mutual cluster authentication of router→worker gRPC calls (proofs: ``grpc_proofs``).

Router side: every call carries a fresh ``x-pdserve-cluster-auth`` header (``CallAuth.sign``:
a timestamp, a random nonce and an HMAC under the cluster secret over the worker's id, the
method, the time and the nonce), and the answer's initial metadata must hold the worker's
proof over that nonce (``CallAuth.verify``) before the router trusts it. All router calls
go through one adapter (``WorkerClient``), so no call site can forget either. The
router's hot path is one ``Session`` stream per worker: its header is signed once when
the stream opens and the worker's proof is checked once, before the first prompt is
written to it; tokens then flow with no per-token cost.

Worker side (``ClusterCallCheck``, a server interceptor): the header's audience must be
this worker, its time within the window, its nonce unseen in the window, its MAC right
(constant time); else UNAUTHENTICATED, counted and logged (``note_refusal``, plane
``grpc``, the reason). A good call's answer opens with the worker's proof.

Why a recorded call cannot be replayed: its nonce is spent on the worker it was sent to
(and remembered for as long as its timestamp could pass), the MAC names that worker and
that method, and it expires after the window. Why a worker's answer cannot be replayed:
it is a MAC over the router's fresh nonce. Neither side ever sends the secret.

A router that does not yet know a worker's id (static membership, probes by endpoint)
signs for the empty audience; the worker then refuses, uncounted, naming its id in the
trailing metadata (``x-pdserve-audience``), and the router signs again for that id. The
id is not secret; a lie about it only makes the next call fail.

The standard health service (``grpc.health.v1``) stays open: orchestrator probes cannot
authenticate, and it tells only SERVING or not. TLS (``grpc_tls``) adds confidentiality.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.core.cluster_secret import ClusterSecret, note_refusal
from pdserve.core.grpc_proofs import (
    AUDIENCE_HEADER,
    AUTH_HEADER,
    PROOF_HEADER,
    CallVerifier,
    check_worker_proof,
    sign_call,
)
from pdserve.core.grpc_tls import GrpcTls

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
_UNCOUNTED = ("audience unknown",)
Metadata = tuple[tuple[str, str], ...]


# ---- client side --------------------------------------------------------------------

class CallAuth:
    """The router's authentication towards one worker. ``audience``: the worker's id when
    known (else learnt from its first refusal, ``learn``)."""

    def __init__(self, secret: ClusterSecret, peer: str, audience: str = "") -> None:
        self._secret = secret
        self.peer = peer
        self.audience = audience

    def sign(self, method: str) -> tuple[Metadata, str]:
        """(the call's metadata, its nonce: keep it for ``verify``)."""
        header, nonce = sign_call(self._secret, self.audience, method)
        return ((AUTH_HEADER, header),), nonce

    def verify(self, method: str, nonce: str, initial_metadata: Any) -> str | None:
        """None if the answer proves the secret; else the reason (counted and logged)."""
        proofs = [v for k, v in initial_metadata or () if k == PROOF_HEADER]
        if len(proofs) == 1 and check_worker_proof(self._secret, self.audience, method,
                                                   nonce, proofs[0]):
            return None
        reason = "worker proof wrong" if proofs else "no worker proof"
        note_refusal("grpc", reason, self.peer)
        return reason

    def learn(self, trailing_metadata: Any) -> bool:
        """Whether a refusal named a worker id other than the one signed for (then
        signing again for it may pass)."""
        named = [v for k, v in trailing_metadata or () if k == AUDIENCE_HEADER]
        if len(named) != 1 or not isinstance(named[0], str) or named[0] == self.audience:
            return False
        self.audience = named[0]
        return True


def refused_for(worker: str, reason: str) -> str:
    return (f"worker {worker} failed cluster authentication ({reason}): it does not hold "
            "this cluster's secret (--cluster-secret-file)")


def aio_channel(endpoint: str, options: Sequence[tuple[str, Any]],
                tls: GrpcTls | None = None) -> grpc.aio.Channel:
    """A channel to a worker: TLS with ``tls``, plain otherwise. The proofs go on each
    call (``CallAuth``)."""
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(), options=options)


def sync_channel(endpoint: str, tls: GrpcTls | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """The same, blocking (probes); close it when done."""
    return (grpc.insecure_channel(endpoint, options=options) if tls is None
            else grpc.secure_channel(endpoint, tls.channel_credentials(), options=options))


# ---- server side --------------------------------------------------------------------

class ClusterCallCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without a good router header (UNAUTHENTICATED), except the
    open health service; answers the others with this worker's proof first."""

    def __init__(self, verifier: CallVerifier) -> None:
        self._verifier = verifier

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        headers = [v for k, v in handler_call_details.invocation_metadata or ()
                   if k == AUTH_HEADER]
        if len(headers) > 1:
            reason: str | None = "malformed token"
        else:
            reason, nonce = self._verifier.check(headers[0] if headers else None, method)
        if reason is None:
            return _proving(handler, ((PROOF_HEADER, self._verifier.proof(method, nonce)),))
        return _refusal(handler, reason, self._verifier.worker_id)


def _proving(handler: grpc.RpcMethodHandler, proof: Metadata) -> grpc.RpcMethodHandler:
    """``handler``, its answer opened by ``proof`` (initial metadata)."""
    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    kind = ("stream_stream" if handler.request_streaming else "unary_stream"
            ) if handler.response_streaming else (
        "stream_unary" if handler.request_streaming else "unary_unary")
    inner = getattr(handler, kind)

    if handler.response_streaming and inspect.isasyncgenfunction(inner):
        async def streaming(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            await context.send_initial_metadata(proof)
            async for item in inner(request, context):
                yield item
        wrapped: Callable[..., Any] = streaming
    else:
        async def single(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.send_initial_metadata(proof)
            return await inner(request, context)
        wrapped = single
    return getattr(grpc, f"{kind}_rpc_method_handler")(wrapped, **codec)


def _refusal(handler: grpc.RpcMethodHandler, reason: str,
             worker_id: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses (naming this worker's
    id in the trailing metadata, for a router that signed for another)."""
    async def refuse(context: grpc.aio.ServicerContext) -> None:
        if reason not in _UNCOUNTED:
            note_refusal("grpc", reason, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"cluster authentication failed ({reason}): this worker needs "
                            f"the cluster secret (--cluster-secret-file)",
                            trailing_metadata=((AUDIENCE_HEADER, worker_id),))

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(context)
        yield  # pragma: no cover - abort raised

    # Request streams (Session) are refused without reading. The handlers must be
    # ``async def`` functions themselves: grpc runs anything else as blocking code.
    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream, **codec)
        return grpc.stream_unary_rpc_method_handler(unary, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def server_interceptors(secret: ClusterSecret | None,
                        worker_id: str = "") -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: none without a secret. ``worker_id``:
    the audience this worker accepts (and proves)."""
    return [] if secret is None else [ClusterCallCheck(CallVerifier(secret, worker_id))]
