"""What ``/openapi.json`` says about responses: every error status the router answers
with, in OpenAI's error shape, and both bodies of a generation endpoint (JSON, or an
SSE stream when ``stream`` is true). Clients and schema-driven tests
(``tests/unit/test_router_schema.py``) rely on it being true.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from pdserve.router.http.openai.response_schemas import ErrorResponse

_ERRORS = {
    400: "invalid request (the field is in error.param)",
    401: "missing or wrong API key (when the router has keys)",
    404: "unknown model or route",
    409: "an X-Request-Id that a running request already uses",
    413: "request body over the router's limit",
    429: "admission: too many requests running and queued (see Retry-After)",
    500: "a worker failed",
    503: "no worker available, or the router is draining",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": why} for status, why in _ERRORS.items()}


def stream_responses(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """A generation endpoint: ``model`` as JSON, or ``text/event-stream`` of its chunks."""
    ok = {"model": model, "description": "the completion; with stream=true an SSE stream "
          "of chunks ending with data: [DONE]",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {200: ok, **ERROR_RESPONSES}


def without_422(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` (FastAPI's) less its 422s: FastAPI documents a 422 for every route with
    a body; this router answers invalid input with OpenAI's 400 instead (``errors.py``)."""
    for item in schema.get("paths", {}).values():
        for operation in item.values():
            operation.get("responses", {}).pop("422", None)
    schemas = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return schema
