"""Body bytes of a streamed response written straight to the client's connection.

The express lane (``dispatch.base.Express``) writes a request's plain token chunks from
the worker session's reader, not from the task serving the request: no task is woken
and no ASGI ``send`` (with the middlewares' wrappers) runs per token. It writes what
the server's own ``send`` would for an ``http.response.body`` message: for uvicorn's
httptools protocol with chunked transfer encoding, a chunk's size line, the bytes and
CRLF, with ``transport.write``. That is uvicorn's internal state (read from the versions
``pyproject.toml`` pins), so it is checked once per response, not assumed:
``DirectWriter.of`` answers None for any other server, protocol or framing (a test
client, uvicorn's h11 protocol, a response without chunked encoding) and for a uvicorn
whose cycle lacks one of the fields it reads or has it of another type, and the
response then goes through ``send`` as before.

Only the body bytes between the first and the last take this path; the response's
start, its last chunks and its end go through ``send``, and the writer is ``ready``
only while the response has started and not ended, the client is connected, the
transport is not closing, and the connection is not paused for a slow reader (uvicorn's
flow control: a full socket buffer). When it is not ready, the chunk takes the usual
path, which waits.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope, Send

# Where ``RouterApp`` leaves the server's own ``send`` in an HTTP request's scope.
SERVER_SEND_KEY = "pdserve.server_send"
# The cycle's flags ``ready`` reads (each a bool on uvicorn's httptools cycle).
_FLAGS = ("response_started", "response_complete", "disconnected")


def capture_server_send(scope: Scope, send: Send) -> None:
    """Keep the server's ``send`` (before any middleware wraps it) in ``scope``."""
    scope[SERVER_SEND_KEY] = send


class DirectWriter:
    """Writes body bytes of one chunked HTTP/1.1 response on uvicorn's transport."""

    __slots__ = ("_cycle", "_flow", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._flow = cycle.flow
        self._transport = cycle.transport

    @classmethod
    def of(cls, scope: Scope) -> DirectWriter | None:
        """The writer for ``scope``'s response, or None where the server is not one it
        knows (then the response is sent through ``send`` alone)."""
        cycle = getattr(scope.get(SERVER_SEND_KEY), "__self__", None)
        if cycle is None or getattr(cycle, "chunked_encoding", None) is not True:
            return None
        flow, transport = getattr(cycle, "flow", None), getattr(cycle, "transport", None)
        if (not callable(getattr(transport, "write", None))
                or not callable(getattr(transport, "is_closing", None))
                or not isinstance(getattr(flow, "write_paused", None), bool)
                or not all(isinstance(getattr(cycle, name, None), bool) for name in _FLAGS)):
            return None
        return cls(cycle)

    def ready(self) -> bool:
        """Whether a write now goes out as ``send`` would send it, without waiting."""
        cycle = self._cycle
        return (cycle.response_started and not cycle.response_complete
                and not cycle.disconnected and not self._flow.write_paused
                and not self._transport.is_closing())

    def write(self, data: bytes) -> None:
        """One body message's bytes (never empty: an empty chunk ends the response);
        only when ``ready``."""
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))
