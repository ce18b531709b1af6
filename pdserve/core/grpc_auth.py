"""Cluster authentication of router→worker gRPC calls.

The router attaches ``x-pdserve-cluster-token`` (``ClusterSecret.grpc_token``, an
HMAC of a fixed label under the cluster secret) to every call as call metadata
(``call_metadata``): all its calls go through one adapter (``WorkerClient``), so no
call site can forget it; blocking probes use a channel interceptor. Workers check
it in constant time in a server interceptor and answer UNAUTHENTICATED otherwise, counting and
logging the refusal (``pdserve.core.cluster_secret.note_refusal``, plane ``grpc``).

The standard health service (``grpc.health.v1``) stays open: orchestrator
probes cannot send the token, and it tells only SERVING or not. pdserve's own
``WorkerService.Health`` is authenticated like every other method.

The token is a bearer credential: it proves the secret without revealing it,
but whoever records it can replay it. Where the network is not trusted, add
TLS to the gRPC channels.
"""

from __future__ import annotations

from collections import namedtuple
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import grpc

from pdserve.core.cluster_secret import ClusterSecret, note_refusal
from pdserve.core.grpc_tls import GrpcTls

TOKEN_HEADER = "x-pdserve-cluster-token"
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


# ---- client side --------------------------------------------------------------------

def _with_token(metadata: Any, token: str) -> list[tuple[str, str | bytes]]:
    return [*(tuple(m) for m in (metadata or ()) if m[0] != TOKEN_HEADER), (TOKEN_HEADER, token)]


def call_metadata(secret: ClusterSecret | None) -> tuple[tuple[str, str], ...]:
    """The metadata every router call carries (``metadata=`` of each call): the cluster
    token with a ``secret``, nothing without. Per call, not a channel interceptor: an
    asyncio interceptor wraps every streamed message of a call in one more coroutine hop,
    and the router reads one message per token. ``WorkerClient`` makes every call."""
    return () if secret is None else ((TOKEN_HEADER, secret.grpc_token),)


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                               "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class SyncTokenInterceptor(grpc.UnaryUnaryClientInterceptor):
    """The same for a blocking channel (the probes tools use)."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._token = secret.grpc_token

    def intercept_unary_unary(self, continuation: Callable[..., Any],
                              client_call_details: grpc.ClientCallDetails, request: Any) -> Any:
        d = client_call_details
        details = _CallDetails(d.method, d.timeout, _with_token(d.metadata, self._token),
                               d.credentials, getattr(d, "wait_for_ready", None),
                               getattr(d, "compression", None))
        return continuation(details, request)


def aio_channel(endpoint: str, options: Sequence[tuple[str, Any]],
                tls: GrpcTls | None = None) -> grpc.aio.Channel:
    """A channel to a worker: TLS with ``tls``, plain otherwise. The cluster token goes
    on each call (``call_metadata``)."""
    if tls is None:
        return grpc.aio.insecure_channel(endpoint, options=options)
    return grpc.aio.secure_channel(endpoint, tls.channel_credentials(), options=options)


def sync_channel(endpoint: str, secret: ClusterSecret | None, tls: GrpcTls | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """The same, blocking (probes); close it when done."""
    channel = (grpc.insecure_channel(endpoint, options=options) if tls is None
               else grpc.secure_channel(endpoint, tls.channel_credentials(), options=options))
    return intercept_sync(channel, secret)


def intercept_sync(channel: grpc.Channel, secret: ClusterSecret | None) -> grpc.Channel:
    return channel if secret is None else grpc.intercept_channel(channel,
                                                                 SyncTokenInterceptor(secret))


# ---- server side --------------------------------------------------------------------

class ClusterTokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call without the cluster's token (UNAUTHENTICATED), except
    the open health service."""

    def __init__(self, secret: ClusterSecret) -> None:
        self._secret = secret

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(OPEN_METHOD_PREFIXES):
            return handler
        tokens = [v for k, v in handler_call_details.invocation_metadata or ()
                  if k == TOKEN_HEADER]
        if len(tokens) == 1 and self._secret.check_grpc_token(tokens[0]):
            return handler
        return _refusal(handler, "wrong token" if tokens else "no token")


def _refusal(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same shape as ``handler`` that only refuses."""
    async def refuse(context: grpc.aio.ServicerContext) -> None:
        note_refusal("grpc", reason, context.peer())
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            f"cluster authentication failed ({reason}): this worker needs "
                            f"the cluster secret (--cluster-secret-file)")

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await refuse(context)
        yield  # pragma: no cover - abort raised

    # Request streams (Session) are refused without reading. The handlers must be
    # ``async def`` functions themselves: grpc runs anything else as blocking code.
    async def stream_in(requests: Any, context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[Any]:
        await refuse(context)
        yield  # pragma: no cover - abort raised

    async def unary_in(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        await refuse(context)

    codec = dict(request_deserializer=handler.request_deserializer,
                 response_serializer=handler.response_serializer)
    if handler.request_streaming:
        if handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_in, **codec)
        return grpc.stream_unary_rpc_method_handler(unary_in, **codec)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(stream, **codec)
    return grpc.unary_unary_rpc_method_handler(unary, **codec)


def server_interceptors(secret: ClusterSecret | None) -> list[grpc.aio.ServerInterceptor]:
    """For ``grpc.aio.server(interceptors=...)``: none without a secret."""
    return [] if secret is None else [ClusterTokenCheck(secret)]
