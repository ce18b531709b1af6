"""Request bodies over ``max_body_bytes`` get a 413 before anything parses them.

A declared ``Content-Length`` over the limit is refused before a byte is read. A body
without one (chunked) or lying about its length is counted as it is read: the read that
crosses the limit raises a 413 ``HTTPException``, which FastAPI passes through its body
reading and the error handlers render; at most ``max_body_bytes`` plus one chunk is ever
held.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.router.http.errors import RequestTooLargeError, send_error


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    def _message(self) -> str:
        return f"The request body is larger than this server's limit of " \
               f"{self.max_body_bytes} bytes."

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await send_error(scope, send, RequestTooLargeError(self._message()))
            return
        received = 0

        async def counting_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, counting_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses a malformed length before we see it
    return None
