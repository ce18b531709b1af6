"""The router's OpenAI-compatible HTTP layer: a thin FastAPI adapter.

Validation lives in ``schemas.py``, tokenization in ``preprocess.py``, running requests
in ``serving.py``, error rendering in ``errors.py``. This module wires them to routes.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import ServiceUnavailableError, error_response, install_error_handlers
from .metrics import RouterMetrics
from .preprocess import Preprocessor, Tokenizer
from .schemas import ChatCompletionRequest, CompletionRequest
from .serving import OpenAIServing
from .types import Dispatcher

COMPLETIONS_PATH = "/v1/completions"
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
_GENERATION_PATHS = frozenset({COMPLETIONS_PATH, CHAT_COMPLETIONS_PATH})
_KNOWN_PATHS = _GENERATION_PATHS | {"/v1/models", "/health", "/metrics"}


def create_app(
    *,
    served_model_name: str,
    max_model_len: int,
    tokenizer: Any,
    dispatcher: Dispatcher,
    registry: CollectorRegistry | None = None,
    request_timeout_s: float = 600.0,
) -> FastAPI:
    """Build the router app. ``tokenizer`` is a Hugging Face tokenizer (see
    ``preprocess.Tokenizer``). Pass the dispatcher's ``registry`` so ``/metrics`` serves both;
    without one the app gets a fresh registry. ``app.state.metrics`` is the
    ``RouterMetrics``, ``app.state.registry`` the registry. ``request_timeout_s`` is the
    longest deadline a request gets (``deadline.py``)."""
    if registry is None:
        registry = CollectorRegistry()
    metrics = RouterMetrics(registry)
    typed_tokenizer: Tokenizer = tokenizer
    preprocessor = Preprocessor(
        served_model_name=served_model_name,
        max_model_len=max_model_len,
        tokenizer=typed_tokenizer,
    )
    serving = OpenAIServing(dispatcher=dispatcher, decoder=typed_tokenizer, metrics=metrics,
                            request_timeout_s=request_timeout_s)

    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None)
    app.state.metrics = metrics
    app.state.registry = registry
    install_error_handlers(app)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    app.include_router(_openai_routes(preprocessor, serving))
    app.include_router(_operations_routes(preprocessor, dispatcher, registry))
    return app


def _openai_routes(preprocessor: Preprocessor, serving: OpenAIServing) -> APIRouter:
    router = APIRouter()

    @router.post(COMPLETIONS_PATH)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.serve(preprocessor.completion(body), request)

    @router.post(CHAT_COMPLETIONS_PATH)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.serve(preprocessor.chat(body), request)

    return router


def _operations_routes(
    preprocessor: Preprocessor, dispatcher: Dispatcher, registry: CollectorRegistry
) -> APIRouter:
    router = APIRouter()
    created = int(time.time())

    @router.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": preprocessor.served_model_name,
            "object": "model",
            "created": created,
            "owned_by": "pdserve",
            "max_model_len": preprocessor.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @router.get("/health")
    async def health() -> Response:
        if dispatcher.is_ready():
            return JSONResponse({"status": "ok"})
        return error_response(
            ServiceUnavailableError("no healthy worker route", code="no_worker_available")
        )

    @router.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return router


class RequestMetricsMiddleware:
    """Counts requests by endpoint and final status, and generation requests in flight.

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
            self.metrics.requests.labels(endpoint, str(status)).inc()
