"""The router's OpenAI-compatible HTTP layer: a thin FastAPI adapter.

Validation lives in ``openai/schemas.py``, tokenization in ``openai/preprocess.py``,
running requests in ``openai/serving.py``, error rendering in ``errors.py``. The edge in
front of the routes is one ASGI middleware per concern, outermost first: metrics
(``RequestMetricsMiddleware``), request ids (``edge/request_ids.py``), client keys and their
tenants (``edge/auth.py``), the body limit (``edge/body_limit.py``), the tenants' limits
(``tenants/accounts.py``), admission (``edge/admission.py``). This module wires them to
routes.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.router.dispatch.base import Dispatcher
from pdserve.router.dispatch.lora_catalog import LoraCatalog
from pdserve.router.http.edge.admission import Admission, AdmissionMiddleware, draining_error
from pdserve.router.http.edge.auth import ApiKeyMiddleware, ApiKeys
from pdserve.router.http.edge.body_limit import BodyLimitMiddleware
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.edge.request_ids import RequestIdMiddleware, arrival_of, request_id_of
from pdserve.router.http.errors import (
    ServiceUnavailableError,
    error_response,
    install_error_handlers,
)
from pdserve.router.http.metrics_route import metrics_routes
from pdserve.router.http.openai.preprocess import Preprocessing, Preprocessor, Tokenizer
from pdserve.router.http.openai.response_schemas import ChatCompletionResponse, CompletionResponse
from pdserve.router.http.openai.schemas import ChatCompletionRequest, CompletionRequest
from pdserve.router.http.openai.serving import OpenAIServing
from pdserve.router.http.openai.stream_writer import capture_server_send
from pdserve.router.http.openai.tool_calls import ToolCalling
from pdserve.router.http.openapi import ERROR_RESPONSES, stream_responses, without_422
from pdserve.router.http.outcome import outcome_of
from pdserve.router.http.tenants.accounts import TenantLimitMiddleware, tenant_accounts
from pdserve.router.http.tenants.salt import salted
from pdserve.router.metrics import RouterMetrics

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
_GENERATION_PATHS = frozenset({COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH})
_KNOWN_PATHS = _GENERATION_PATHS | {"/v1/models", "/health", "/metrics", "/workers",
                                    "/prefix_index"}


def create_app(
    *,
    served_model_name: str,
    max_model_len: int,
    tokenizer: Any,
    dispatcher: Dispatcher,
    registry: CollectorRegistry | None = None,
    edge: EdgeConfig | None = None,
    request_timeout_s: float = 600.0,
    metrics_enabled: bool = True,
    tool_calling: ToolCalling | None = None,
    eos_token_ids: frozenset[int] | None = None,
    secret: ClusterSecret | None = None,
    loras: LoraCatalog | None = None,
) -> FastAPI:
    """Build the router app. ``tokenizer`` is a Hugging Face tokenizer (see
    ``preprocess.Tokenizer``). Pass the dispatcher's ``registry`` so ``/metrics`` serves both;
    without one the app gets a fresh registry. ``edge``: keys, admission and body limits
    (default: ``EdgeConfig()``, no keys). ``request_timeout_s`` is the longest deadline a
    request gets (``Deadline``). ``metrics_enabled=False``: no metric work per request,
    and ``/metrics`` answers 404 (``router/metrics/``). ``app.state`` holds ``metrics`` (the
    ``RouterMetrics``), ``registry`` (None with metrics off), ``admission`` (drain it with
    ``start_drain()``), ``tenants`` (each key's ``TenantAccount``). ``tool_calling``:
    vLLM's tool parser (``openai/tool_calls.py``); None: tool choices other than ``none``
    are refused. ``eos_token_ids``: the ids the engines end a sequence on (default: the
    tokenizer's end of sequence). ``secret``: the cluster secret, which keys the tenants'
    salts (``tenants/salt.py``; needed with ``--tenant-isolation key``). ``loras``: the
    LoRA adapters served (a request's ``model`` may name one; ``/v1/models`` lists them)."""
    edge = edge or EdgeConfig()
    if not metrics_enabled:
        registry = None
    elif registry is None:
        registry = CollectorRegistry()
    admission = Admission(edge.max_concurrent, edge.max_queued, edge.max_queue_wait_s)
    metrics = RouterMetrics(registry, served_model_name, admission, sorted(_GENERATION_PATHS))
    typed_tokenizer: Tokenizer = tokenizer
    preprocessing = Preprocessing(lambda t: Preprocessor(
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        tokenizer=t,
        tool_calling=tool_calling,
        eos_token_ids=eos_token_ids,
        loras=loras,
    ), typed_tokenizer)
    serving = OpenAIServing(dispatcher=dispatcher, decoder=typed_tokenizer, metrics=metrics,
                            request_timeout_s=request_timeout_s)

    app = RouterApp(title="pdserve router", docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.registry = registry
    app.state.admission = admission
    tenants = app.state.tenants = tenant_accounts(edge, registry, secret)
    install_error_handlers(app)
    app.add_middleware(AdmissionMiddleware, admission=admission, paths=_GENERATION_PATHS)
    app.add_middleware(TenantLimitMiddleware, paths=_GENERATION_PATHS)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=edge.max_body_bytes)
    app.add_middleware(ApiKeyMiddleware, keys=ApiKeys(edge.api_keys), tenants=tenants)
    app.add_middleware(RequestIdMiddleware)
    if metrics.enabled:
        app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.include_router(_openai_routes(preprocessing, serving))
    app.include_router(_operations_routes(preprocessing.threaded, dispatcher, admission,
                                          loras))
    app.include_router(metrics_routes(registry, per_tenant=bool(edge.api_keys)))
    return app


def _openai_routes(preprocessing: Preprocessing, serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post(COMPLETIONS_PATH, response_model=None,
                 responses=stream_responses(CompletionResponse))
    async def completions(body: CompletionRequest, request: Request) -> Response:
        body.cache_salt = salted(request.scope, body.cache_salt)
        generation = await preprocessing.completion(
            body, _body_bytes(request), request_id_of(request.scope), arrival_of(request.scope))
        return await serving.serve(generation, request)

    @router.post(CHAT_COMPLETIONS_PATH, response_model=None,
                 responses=stream_responses(ChatCompletionResponse))
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        body.cache_salt = salted(request.scope, body.cache_salt)
        generation = await preprocessing.chat(
            body, _body_bytes(request), request_id_of(request.scope), arrival_of(request.scope))
        return await serving.serve(generation, request)

    return router


def _body_bytes(request: Request) -> int | None:
    """The body's size as the client declared it (None: not declared, or not a number)."""
    declared = request.headers.get("content-length")
    return int(declared) if declared is not None and declared.isdigit() else None


def _operations_routes(
    preprocessor: Preprocessor, dispatcher: Dispatcher, admission: Admission,
    loras: LoraCatalog | None = None,
) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models", responses=ERROR_RESPONSES)
    async def models() -> dict[str, Any]:
        """The model only while a healthy decode worker serves it (every worker of this
        router serves its one model): a client polling this waits for servable. Then
        each LoRA adapter, its ``parent`` the model, as vLLM lists them."""
        if not dispatcher.is_ready():
            return {"object": "list", "data": []}
        card = {
            "id": preprocessor.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "max_model_len": preprocessor.max_model_len,
        }
        cards = [card, *({"id": a.name, "object": "model", "created": created,
                          "owned_by": "pdserve", "root": a.path, "parent": card["id"],
                          "max_model_len": preprocessor.max_model_len}
                         for a in (loras.adapters() if loras is not None else ()))]
        return {"object": "list", "data": cards}

    @router.get("/health", responses=ERROR_RESPONSES)
    async def health() -> Response:
        if admission.draining:
            return error_response(draining_error())
        if dispatcher.is_ready():
            return JSONResponse({"status": "ok"})
        return error_response(
            ServiceUnavailableError("no healthy worker route", code="no_worker_available")
        )

    return router


class RouterApp(FastAPI):
    """The router's app: keeps the server's own ``send`` in each HTTP request's scope,
    before any middleware wraps it, for the stream writer (``openai/stream_writer.py``)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            capture_server_send(scope, send)
        await super().__call__(scope, receive, send)

    def openapi(self) -> dict[str, Any]:
        """FastAPI's schema (built on the first call, then kept in ``openapi_schema``)
        less the 422s this router never answers (``openapi.without_422``)."""
        if self.openapi_schema is None:
            self.openapi_schema = without_422(super().openapi())
        return self.openapi_schema


class RequestMetricsMiddleware:
    """Counts requests by endpoint and final status, failed generation requests by
    reason, and generation requests in flight.

    The final status is the recorded outcome (``outcome.py``) when there is one: a
    stream that failed after its 200 counts with its error's status, not as a 200.
    Pure ASGI (not ``BaseHTTPMiddleware``) so streaming responses pass through untouched
    and the in-flight gauge covers the whole stream.
    """

    def __init__(self, app: ASGIApp, metrics: RouterMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        status = 500  # if the app raises before answering, ServerErrorMiddleware sends a 500

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        tracked = path in _GENERATION_PATHS
        if tracked:
            self.metrics.requests_in_flight.inc()
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            if tracked:
                self.metrics.requests_in_flight.dec()
            endpoint = path if path in _KNOWN_PATHS else "other"
            outcome = outcome_of(scope)
            final = outcome.status if outcome is not None else status
            self.metrics.requests.labels(endpoint, str(final)).inc()
            if tracked and final != 200:
                reason = outcome.reason if outcome is not None else f"http_{final}"
                self.metrics.request_failures.labels(endpoint, reason).inc()
