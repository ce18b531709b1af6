"""Request ids: the client's ``X-Request-Id`` (checked) or a fresh one, for every request.

The id is echoed in the ``X-Request-Id`` response header (errors and streams included),
set in ``pdserve.core.logs.request_id_var`` for the request's log lines, and put in the scope
(``request_id_of``), where the routes read it: ``cmpl-<id>`` / ``chatcmpl-<id>`` is the
OpenAI ``id`` of the response. A fresh id is 128 bits from ``secrets`` (unguessable).

The client's id is a label, never a handle: the workers' id of a request is its response
id and 128 more random bits (``openai/preprocess.py``), so two requests with one client
id (of one tenant or two, in one router process or several) are two requests on the
workers, an abort of one never ends the other, and no client learns whether an id it
guessed is running (there is no "already running" answer to probe).
"""

from __future__ import annotations

import secrets
import time

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.core.logs import request_id_var
from pdserve.router.http.errors import InvalidRequestError, send_error

HEADER = "x-request-id"
MAX_REQUEST_ID_LEN = 128
_ID_KEY = "pdserve.request_id"
_ARRIVAL_KEY = "pdserve.arrival_s"


def request_id_of(scope: Scope) -> str:
    return str(scope[_ID_KEY])


def arrival_of(scope: Scope) -> float:
    """``time.perf_counter()`` when the request reached the router (queueing included)."""
    return float(scope.get(_ARRIVAL_KEY, time.perf_counter()))


def check_request_id(value: str) -> str | None:
    """Why ``value`` is not a usable id, or None when it is: printable ASCII without
    spaces (it goes into log lines and worker ids), at most ``MAX_REQUEST_ID_LEN``."""
    if not value:
        return "must not be empty"
    if len(value) > MAX_REQUEST_ID_LEN:
        return f"must be at most {MAX_REQUEST_ID_LEN} characters"
    if not (value.isascii() and value.isprintable()) or " " in value:
        return "must be printable ASCII without spaces"
    return None


class RequestIdMiddleware:
    """The outermost middleware: every response below it carries the id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[_ARRIVAL_KEY] = time.perf_counter()
        given = _header(scope)
        request_id = given if given is not None else secrets.token_hex(16)
        problem = None if given is None else check_request_id(given)
        if problem is not None:
            request_id = secrets.token_hex(16)  # the bad one is not echoed back
        scope[_ID_KEY] = request_id
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        try:
            if problem is not None:
                await send_error(scope, send_with_id, InvalidRequestError(
                    f"X-Request-Id {problem}", param="X-Request-Id", code="invalid_request_id"))
            else:
                await self.app(scope, receive, send_with_id)
        finally:
            request_id_var.reset(token)


def _header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None
