"""The HTTP side of a streamed request's express lane (``dispatch.base.Express``): the
sink that writes a plain token chunk to the client from the worker session's reader.

The streaming body (``serving.OpenAIServing._events``) opens the lane once its first
chunk is written and closes it when it stops reading. In between, each ordinary chunk
that arrives while the body waits for the next is consumed (``RequestOutput.consume_plain``:
text, metrics), encoded (``ResponseFormatter.plain_frame``: ``encode_stream``'s plain
path) and written (``DirectWriter``) by the sink, exactly as a turn of the body's loop
would have done it; any other chunk (the last, one with logprobs, one that arrives while
the client is slow) reaches the body as before. The bytes are the same either way
(``tests/unit/test_sse_golden.py`` runs the goldens through both).
"""

from __future__ import annotations

import orjson

from pdserve.router.http.edge.direct_write import DirectWriter
from pdserve.router.http.openai.request_output import Choices
from pdserve.router.http.openai.responses import ResponseFormatter


def close_express(choices: Choices) -> None:
    """Close the request's express lane: the body stops reading (however it stops)."""
    if choices.express is not None:
        choices.express.sink = None


def open_express(choices: Choices, formatter: ResponseFormatter) -> None:
    """Open the request's express lane (``dispatch.base.Express``), once its first chunk
    is written, where every later chunk but the last is plain text (one choice, no stop
    strings, no logprobs, no token ids, no tools) and the server is one whose connection
    ``DirectWriter`` writes to. The lane's sink does what one turn of ``_events``' loop
    does for such a chunk (``RequestOutput.consume_plain``, ``encode_stream``'s plain
    path, the write) and declines, untouched, a chunk it cannot write now: the client is slow or
    gone."""
    express, output = choices.express, choices.first
    if express is None or output.scope is None or output.request.stop:
        return
    frame = formatter.plain_frame(output.index)
    writer = DirectWriter.of(output.scope) if frame is not None else None
    if frame is None or writer is None:
        return
    head, tail = frame
    consume, ready, write = output.consume_plain, writer.ready, writer.write

    def sink(token_ids: tuple[int, ...]) -> bool:
        if not ready():
            return False
        if text := consume(token_ids):
            write(head + orjson.dumps(text) + tail)
        return True

    express.sink = sink
