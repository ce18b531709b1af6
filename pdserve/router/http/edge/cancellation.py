"""How the router stops work it no longer needs: closing the dispatcher's chunk iterators
(which aborts the request on the workers) and noticing that a client went away."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

T = TypeVar("T")
# Bounds a dispatcher's cleanup so a stuck abort cannot hold a request handler forever.
CLOSE_TIMEOUT_S = 30.0


class ClientDisconnectedError(Exception):
    """The client closed the connection before the answer was ready."""


async def close_now(iterator: Any) -> None:
    """``aclose()`` an async iterator, shielded: a cancellation (the usual reason to close)
    must not interrupt the dispatcher's cleanup. Iterators without ``aclose`` are left."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is None:
        return
    with anyio.move_on_after(CLOSE_TIMEOUT_S, shield=True):
        try:
            await aclose()
        except Exception:
            logger.exception("closing a chunk iterator failed")


@asynccontextmanager
async def closing(iterator: Any) -> AsyncIterator[None]:
    """Close the async iterator on exit, whatever the exit (break, error, cancellation)."""
    try:
        yield
    finally:
        await close_now(iterator)


async def until_disconnect(request: Request, work: Callable[[], Awaitable[T]]) -> T:
    """Await ``work()`` in this task; if the client disconnects first, cancel it and raise
    ``ClientDisconnectedError``. The body must have been read: the next ASGI message is
    then ``http.disconnect``, so this waits on it instead of polling."""
    with anyio.CancelScope() as scope:
        watcher = asyncio.create_task(_cancel_on_disconnect(request, scope))
        try:
            return await work()
        finally:
            watcher.cancel()
    raise ClientDisconnectedError()


async def _cancel_on_disconnect(request: Request, scope: anyio.CancelScope) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    scope.cancel()


class ClosingStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always closes its body iterator when it ends.

    On a client disconnect Starlette cancels the sending task. If that task was inside
    ``send()`` (a slow client's full socket buffer), the body generator stays suspended at
    a ``yield`` until the garbage collector finalizes it. Closing it here runs its cleanup,
    and so the workers' abort, at once.
    """

    def __init__(self, content: Any, *args: Any, source: Any = None, **kwargs: Any) -> None:
        """``source``: the iterator the body reads; closed too, in case the body never
        started (a disconnect before the first write) and so never closed it itself."""
        super().__init__(content, *args, **kwargs)
        self._source = source

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await close_now(self.body_iterator)
            await close_now(self._source)
