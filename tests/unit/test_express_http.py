"""The express lane's HTTP side (``router/http/openai/stream_writer.py``) through
a real uvicorn server: a client too slow to read (the connection pauses, the lane hands
the chunks back to the body, which waits) gets the same bytes as in-process; a client
that goes away mid-stream has its request aborted; a server ``StreamWriter`` does not
know (in-process ASGI) gets no lane at all.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import time
from typing import Any

import pytest
from unit.fakes import (
    ROUTER_MODEL,
    FakeDispatcher,
    asgi_http_client,
    serve_in_thread,
    wait_until,
)

from pdserve.router.http.app import create_app
from pdserve.router.http.openai.stream_writer import SERVER_SEND_KEY, StreamWriter

NUM_TOKENS = 3000
_IDS = re.compile(rb'"id":"[^"]*"|"created":\d+')


def _app(tokenizer: Any, fake: FakeDispatcher) -> Any:
    return create_app(served_model_name=ROUTER_MODEL, max_model_len=NUM_TOKENS + 64,
                      tokenizer=tokenizer, dispatcher=fake)


def _request(max_tokens: int = NUM_TOKENS) -> bytes:
    body = json.dumps({"model": ROUTER_MODEL, "prompt": "Hello", "max_tokens": max_tokens,
                       "stream": True}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


def _dechunk(raw: bytes) -> bytes:
    """The body of a chunked HTTP/1.1 response."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower(), head
    parts: list[bytes] = []
    at = 0
    while True:
        end = rest.index(b"\r\n", at)
        size = int(rest[at:end], 16)
        if size == 0:
            return b"".join(parts)
        parts.append(rest[end + 2:end + 2 + size])
        assert rest[end + 2 + size:end + 4 + size] == b"\r\n"
        at = end + 4 + size


def _fake(tokenizer: Any, **fields: Any) -> FakeDispatcher:
    text = "The quick brown fox jumps over the lazy dog. " * (NUM_TOKENS // 8)
    return FakeDispatcher(output_ids=tokenizer.encode(text)[:NUM_TOKENS], **fields)


async def test_a_client_too_slow_to_read_gets_the_same_bytes(tokenizer: Any) -> None:
    """The server's send buffer is small and the client reads only after a pause: the
    connection pauses writing, the lane declines, the body waits, and the bytes are those
    the in-process path sends, in order."""
    fake = _fake(tokenizer)
    async with asgi_http_client(_app(tokenizer, _fake(tokenizer))) as http:
        reply = await http.post("/v1/completions", content=_request().partition(b"\r\n\r\n")[2],
                                headers={"content-type": "application/json"})
    expected = _IDS.sub(b"", reply.content)

    def slow_client(url: str) -> bytes:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            conn.sendall(_request())
            time.sleep(1.0)  # the server writes until its buffers are full
            raw = b""
            while not raw.endswith(b"0\r\n\r\n"):
                data = conn.recv(65536)
                if not data:
                    break
                raw += data
        return raw

    with serve_in_thread(_app(tokenizer, fake), send_buffer=4096) as url:
        raw = await asyncio.to_thread(slow_client, url)

    assert _IDS.sub(b"", _dechunk(raw)) == expected
    assert expected.count(b"data: {") == NUM_TOKENS
    # The lane carried some of the chunks and handed others back while paused.
    assert 0 < fake.express_taken < NUM_TOKENS - 2


async def test_a_client_gone_mid_stream_has_its_request_aborted(tokenizer: Any) -> None:
    fake = _fake(tokenizer, delay_s=0.002)
    with serve_in_thread(_app(tokenizer, fake)) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(_request())
            raw = b""
            while raw.count(b"data: {") < 20:
                raw += conn.recv(65536)
        assert await asyncio.to_thread(wait_until, lambda: len(fake.aborted) == 1, 10.0)
    assert fake.completed == [] and 0 < fake.express_taken < NUM_TOKENS - 2


@pytest.mark.parametrize("scope", [{}, {SERVER_SEND_KEY: None},
                                   {SERVER_SEND_KEY: lambda message: None}])
def test_no_writer_for_a_server_it_does_not_know(scope: dict[str, Any]) -> None:
    assert StreamWriter.of(scope) is None
