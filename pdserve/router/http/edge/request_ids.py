"""Request ids: the client's ``X-Request-Id`` (checked) or a fresh one, for every request.

The id is echoed in the ``X-Request-Id`` response header (errors and streams included),
set in ``pdserve.core.logs.request_id_var`` for the request's log lines, and put in the scope
(``request_id_of``), where the routes read it: the workers get ``cmpl-<id>`` /
``chatcmpl-<id>`` as their request id, the OpenAI ``id`` of the response.

Two generation requests running at once with the same client id would share one id on
the workers, where an abort of one would end both: the second is refused (409).
"""

from __future__ import annotations

import time
import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.core.logs import request_id_var
from pdserve.router.http.errors import ConflictError, InvalidRequestError, send_error

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

    def __init__(self, app: ASGIApp, unique_paths: frozenset[str]) -> None:
        self.app = app
        self._unique_paths = unique_paths
        self._active: set[str] = set()  # client ids of running unique-path requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope[_ARRIVAL_KEY] = time.perf_counter()
        given = _header(scope)
        request_id = given if given is not None else uuid.uuid4().hex
        problem = None if given is None else check_request_id(given)
        if problem is not None:
            request_id = uuid.uuid4().hex  # the bad one is not echoed back
        scope[_ID_KEY] = request_id
        token = request_id_var.set(request_id)

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
            await send(message)

        claimed = given is not None and problem is None and scope["path"] in self._unique_paths
        try:
            if problem is not None:
                await send_error(scope, send_with_id, InvalidRequestError(
                    f"X-Request-Id {problem}", param="X-Request-Id", code="invalid_request_id"))
            elif claimed and request_id in self._active:
                claimed = False
                await send_error(scope, send_with_id, ConflictError(
                    f"a request with X-Request-Id {request_id!r} is already running",
                    param="X-Request-Id", code="duplicate_request_id"))
            else:
                if claimed:
                    self._active.add(request_id)
                await self.app(scope, receive, send_with_id)
        finally:
            if claimed:
                self._active.discard(request_id)
            request_id_var.reset(token)


def _header(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"x-request-id":
            return value.decode("latin-1")
    return None
