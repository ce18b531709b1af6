"""A streamed response's chunk sink (``dispatch.base.ChunkSink``): ordinary token chunks
written to the client's connection by the worker session's reader, not by the task
serving the request, so no task is woken and no ASGI ``send`` (with the middlewares'
wrappers) runs per token.

The streaming body (``serving.OpenAIServing._events``) ``open``s the sink once its first
chunk is written, where every later chunk but the last is plain text (one choice, no
stop strings, no logprobs, no token ids, no tools), and ``close``s it when it stops
reading. In between, a chunk the dispatcher offers while the body waits for the next is
consumed (``RequestOutput.consume``), encoded (the formatter's plain frame, what
``encode_stream`` writes for it) and written here, exactly as a turn of the body's loop
would have done it; the sink declines, untouched, a chunk it cannot write now (the
client is slow or gone), and the body gets it as before. The bytes are the same either
way (``tests/unit/test_sse_golden.py`` runs the goldens through both).

The write is what the server's own ``send`` does for an ``http.response.body`` message:
for uvicorn's httptools protocol with chunked transfer encoding, a chunk's size line,
the bytes and CRLF, with ``transport.write``. That is uvicorn's internal state (read from
the versions ``pyproject.toml`` pins), so it is checked once per response, not assumed:
``open`` stays closed (``StreamWriter.of``, for a response already started, answers None)
for any other server, protocol or framing (a test
client, uvicorn's h11 protocol, a response without chunked encoding) and for a uvicorn
whose cycle lacks one of the fields it reads or has it of another type, and the
response then goes through ``send`` alone. The writer is ``ready`` only while the
response has started and not ended, the client is connected, the transport is not
closing, and the connection is not paused for a slow reader (uvicorn's flow control: a
full socket buffer).
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.types import Scope, Send

from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.http.openai.request_output import RequestOutput
from pdserve.router.http.openai.responses import ResponseFormatter

# Where ``RouterApp`` leaves the server's own ``send`` in an HTTP request's scope.
SERVER_SEND_KEY = "pdserve.server_send"
# The cycle's flags ``ready`` reads (each a bool on uvicorn's httptools cycle).
_FLAGS = ("response_started", "response_complete", "disconnected")


def capture_server_send(scope: Scope, send: Send) -> None:
    """Keep the server's ``send`` (before any middleware wraps it) in ``scope``."""
    scope[SERVER_SEND_KEY] = send


class StreamWriter:
    """Writes the plain chunks of one chunked HTTP/1.1 response on uvicorn's transport."""

    __slots__ = ("_scope", "_cycle", "_flow", "_transport", "_output", "_head", "_tail",
                 "accepting")

    def __init__(self, scope: Scope, cycle: Any = None) -> None:
        """The sink of ``scope``'s response (it knows its server's cycle once ``open``)."""
        self._scope = scope
        self._cycle: Any = None  # uvicorn's internals: typed by ``_known_cycle``'s checks
        self._flow: Any = None
        self._transport: Any = None
        if cycle is not None:
            self._attach(cycle)
        self._output: RequestOutput | None = None  # set while open
        self.accepting = False  # ``ChunkSink.accepting``: open
        self._head = self._tail = b""

    @classmethod
    def of(cls, scope: Scope) -> StreamWriter | None:
        """The writer for ``scope``'s response once its head went out, or None where the
        server is not one it knows (then the response is sent through ``send`` alone)."""
        cycle = _known_cycle(scope)
        return None if cycle is None else cls(scope, cycle)

    def open(self, output: RequestOutput, formatter: ResponseFormatter) -> None:
        """Start taking ``output``'s chunks (its first is written), where every later
        one but the last is plain text and the server is one it knows; else stay closed."""
        frame = formatter.plain_frame(output.index)
        if frame is None or output.request.stop:
            return
        if self._cycle is None:
            cycle = _known_cycle(self._scope)
            if cycle is None:
                return
            self._attach(cycle)
        self._head, self._tail = frame
        self._output = output
        self.accepting = True

    def close(self) -> None:
        """Take no more chunks: the body stops reading (however it stops)."""
        self._output = None
        self.accepting = False

    def offer(self, chunk: TokenChunk) -> bool:
        """``ChunkSink.offer``: consume and write ``chunk`` now, or decline it untouched."""
        output = self._output
        if output is None or not self.ready():
            return False
        if text := output.consume(chunk).text:
            self.write(self._head + orjson.dumps(text) + self._tail)
        return True

    def ready(self) -> bool:
        """Whether a write now goes out as ``send`` would send it, without waiting."""
        cycle = self._cycle
        return (cycle.response_started and not cycle.response_complete
                and not cycle.disconnected and not self._flow.write_paused
                and not self._transport.is_closing())

    def _attach(self, cycle: Any) -> None:
        self._cycle, self._flow, self._transport = cycle, cycle.flow, cycle.transport

    def write(self, data: bytes) -> None:
        """One body message's bytes (never empty: an empty chunk ends the response);
        only when ``ready``."""
        self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))


def _known_cycle(scope: Scope) -> Any:
    """The uvicorn httptools cycle of ``scope``'s chunked response, where it has every
    field the writer reads with the type it expects (its chunked encoding is decided
    when the response starts); else None."""
    cycle = getattr(scope.get(SERVER_SEND_KEY), "__self__", None)
    if cycle is None or getattr(cycle, "chunked_encoding", None) is not True:
        return None
    flow, transport = getattr(cycle, "flow", None), getattr(cycle, "transport", None)
    if (not callable(getattr(transport, "write", None))
            or not callable(getattr(transport, "is_closing", None))
            or not isinstance(getattr(flow, "write_paused", None), bool)
            or not all(isinstance(getattr(cycle, name, None), bool) for name in _FLAGS)):
        return None
    return cycle
