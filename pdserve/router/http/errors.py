"""The one place that maps exceptions to OpenAI error JSON and HTTP status codes.

Body: ``{"error": {"message": str, "type": str, "param": str | None, "code": str | None}}``.
The same body is used for HTTP error responses and for the error event of a stream that
has already started.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Message, Scope, Send

from pdserve.router.cluster.errors import (
    ClusterError,
    Conflict,
    Failed,
    Invalid,
    NotFound,
    Unavailable,
)
from pdserve.router.dispatch.base import (
    DeadlineExceededError,
    NoWorkerAvailableError,
    RequestRejectedError,
    WorkerFailedError,
)
from pdserve.router.http.base import APIError
from pdserve.router.http.outcome import outcome_reason, record_outcome

logger = logging.getLogger(__name__)

# Pydantic puts union member names into error locations; they are not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


class InvalidRequestError(APIError):
    status_code = 400
    error_type = "invalid_request_error"


class ContextLengthExceededError(InvalidRequestError):
    def __init__(self, *, num_prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the "
            f"prompt, {max_tokens} for the completion). Please reduce the length of the "
            "prompt or max_tokens.",
            param="prompt" if num_prompt_tokens >= max_model_len else "max_tokens",
            code="context_length_exceeded",
        )


class ModelNotFoundError(APIError):
    status_code = 404
    error_type = "invalid_request_error"

    def __init__(self, model: str):
        super().__init__(
            f"The model '{model}' does not exist.", param="model", code="model_not_found"
        )


class NotFoundError(APIError):
    """What a request names does not exist (a worker id)."""

    status_code = 404
    error_type = "invalid_request_error"


class RouteNotFoundError(NotFoundError):
    """No such route."""


class MethodNotAllowedError(APIError):
    status_code = 405
    error_type = "invalid_request_error"


class AuthenticationError(APIError):
    status_code = 401
    error_type = "authentication_error"


class PermissionDeniedError(APIError):
    status_code = 403
    error_type = "permission_error"


class ConflictError(APIError):
    status_code = 409
    error_type = "invalid_request_error"


class RequestTooLargeError(APIError):
    status_code = 413
    error_type = "invalid_request_error"

    def __init__(self, message: str):
        super().__init__(message, code="request_too_large")


class TooManyRequestsError(APIError):
    """Admission refused: the client should retry after ``retry_after_s``. ``code``:
    too_many_requests (the router is full), rate_limit_exceeded (a tenant's own limit)."""

    status_code = 429
    error_type = "rate_limit_error"

    def __init__(self, message: str, retry_after_s: int, code: str = "too_many_requests"):
        super().__init__(message, code=code)
        self.retry_after_s = retry_after_s


class ServiceUnavailableError(APIError):
    status_code = 503
    error_type = "service_unavailable"


class ServerError(APIError):
    status_code = 500
    error_type = "server_error"


class GatewayTimeoutError(APIError):
    status_code = 504
    error_type = "timeout_error"


# A cluster operation's refusal or failure (``router/cluster``), by kind.
_CLUSTER: dict[type[ClusterError], type[APIError]] = {
    NotFound: NotFoundError, Invalid: InvalidRequestError, Conflict: ConflictError,
    Unavailable: ServiceUnavailableError, Failed: ServerError}

_EXPECTED = (
    APIError,
    ClusterError,
    NoWorkerAvailableError,
    WorkerFailedError,
    DeadlineExceededError,
    RequestRejectedError,
    RequestValidationError,
    ValidationError,
    StarletteHTTPException,
)


def to_api_error(exc: BaseException) -> APIError:
    """Map any exception raised while serving a request to its OpenAI error."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ClusterError):
        kind = next((api for cls, api in _CLUSTER.items() if isinstance(exc, cls)),
                    ServerError)
        return kind(exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, NoWorkerAvailableError):
        return ServiceUnavailableError(
            str(exc) or "no worker available", code="no_worker_available"
        )
    if isinstance(exc, DeadlineExceededError):
        return GatewayTimeoutError(str(exc) or "request timed out", code="timeout")
    if isinstance(exc, WorkerFailedError):
        return ServerError(str(exc) or "worker failed", code="worker_failed")
    if isinstance(exc, RequestRejectedError):
        return InvalidRequestError(str(exc) or "the request was refused")
    if isinstance(exc, RequestValidationError | ValidationError):
        return _from_validation_errors(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        return _from_http_exception(exc)
    return ServerError("internal server error")


def error_response(exc: BaseException) -> JSONResponse:
    error = to_api_error(exc)
    headers = {**error_headers(error), **(getattr(exc, "headers", None) or {})}
    return JSONResponse(error.body(), status_code=error.status_code, headers=headers or None)


def error_headers(error: APIError) -> dict[str, str]:
    """Headers an error's response carries besides its body (``Retry-After`` on a 429,
    the auth scheme on a 401)."""
    if isinstance(error, TooManyRequestsError):
        return {"Retry-After": str(error.retry_after_s)}
    if isinstance(error, AuthenticationError):
        return {"WWW-Authenticate": "Bearer"}
    return {}


async def send_error(scope: Scope, send: Send, error: APIError) -> None:
    """Answer from ASGI middleware (before any route runs) with the error's JSON and
    headers, and record the outcome for the metrics."""
    record_outcome(scope, error.status_code, outcome_reason(error))
    response = JSONResponse(error.body(), status_code=error.status_code,
                            headers=error_headers(error))
    await response(scope, _no_receive, send)


async def _no_receive() -> Message:
    return {"type": "http.disconnect"}


def install_error_handlers(app: FastAPI) -> None:
    """Render every error the app raises as OpenAI error JSON (validation errors as 400)."""

    async def handle(request: Request, exc: Exception) -> JSONResponse:
        response = error_response(exc)
        record_outcome(request.scope, response.status_code, outcome_reason(to_api_error(exc)))
        where = f"{request.method} {request.url.path}"
        if not isinstance(exc, _EXPECTED):
            logger.error("%s -> %d: unexpected error", where, response.status_code, exc_info=exc)
        else:
            logger.info("%s -> %d: %s", where, response.status_code, to_api_error(exc).message)
        return response

    for exc_class in (*_EXPECTED, Exception):
        app.add_exception_handler(exc_class, handle)


def _from_http_exception(exc: StarletteHTTPException) -> APIError:
    if exc.status_code == 413:  # the body limit, found while FastAPI read the body
        return RequestTooLargeError(str(exc.detail))
    if exc.status_code == 404:
        return RouteNotFoundError("Not found: no such route")
    if exc.status_code == 405:
        return MethodNotAllowedError("Method not allowed for this route")
    if exc.status_code < 500:
        error: APIError = InvalidRequestError(str(exc.detail))
    else:
        error = ServerError(str(exc.detail))
    error.status_code = exc.status_code
    return error


def _from_validation_errors(errors: Sequence[Any]) -> InvalidRequestError:
    if not errors:
        return InvalidRequestError("invalid request")
    # A value_error is our own explanation; prefer it over a union's "wrong type" noise.
    chosen = next((e for e in errors if e.get("type") == "value_error"), errors[0])
    if chosen.get("type") == "json_invalid":
        detail = chosen.get("ctx", {}).get("error", "")
        return InvalidRequestError(f"The request body is not valid JSON: {detail}".rstrip(": "))
    loc = [part for part in chosen.get("loc", ()) if not _is_type_tag(part)]
    if loc and loc[0] == "body":
        loc = loc[1:]
    message = str(chosen.get("msg", "invalid value")).removeprefix("Value error, ")
    if not loc and isinstance(param := (chosen.get("ctx") or {}).get("param"), str):
        return InvalidRequestError(message, param=param)  # a cross-field check naming it
    if not loc:
        return InvalidRequestError(f"Invalid request body: {message}")
    param = str(loc[0])
    return InvalidRequestError(f"{_format_loc(loc)}: {message}", param=param)


def _is_type_tag(part: object) -> bool:
    return isinstance(part, str) and (not part.isidentifier() or part in _TYPE_TAGS)


def _format_loc(loc: Sequence[object]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".")
