"""HTTP/1.1 pipelining through a real uvicorn socket (``router/http/edge/pipelining.py``):
a client that sends two requests on one connection and leaves while the first runs has
every started generation aborted, streaming or not, and none left running."""

from __future__ import annotations

import asyncio
import json
import socket
from typing import Any

import pytest
from unit.fakes import ROUTER_MODEL, FakeDispatcher, serve_in_thread, wait_until

from pdserve.router.http.app import create_app

NUM_TOKENS = 2000


def _request(stream: bool) -> bytes:
    body = json.dumps({"model": ROUTER_MODEL, "prompt": "Hello", "max_tokens": NUM_TOKENS,
                       "stream": stream}).encode()
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body))


def _settled(fake: FakeDispatcher) -> bool:
    """Every generation started has ended (aborted, completed or failed)."""
    return len(fake.calls) == len(fake.aborted) + len(fake.completed) + len(fake.failed)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_pipelining_client_that_leaves_has_its_generations_aborted(
        tokenizer: Any, stream: bool) -> None:
    fake = FakeDispatcher(output_ids=[tokenizer.encode(" the")[0]] * NUM_TOKENS,
                          delay_s=0.005)  # some 10 s to the end: far past the waits below
    app = create_app(served_model_name=ROUTER_MODEL, max_model_len=NUM_TOKENS + 64,
                     tokenizer=tokenizer, dispatcher=fake)
    with serve_in_thread(app) as url:
        port = int(url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(_request(stream) + _request(stream))  # one write, two requests
            if stream:  # the first answer is under way
                raw = b""
                while raw.count(b"data: {") < 5:
                    raw += conn.recv(65536)
            else:
                assert await asyncio.to_thread(wait_until, lambda: len(fake.calls) == 1, 5.0)
        # The client is gone: the running generation is aborted well before its end.
        assert await asyncio.to_thread(wait_until, lambda: len(fake.aborted) >= 1, 5.0)
        assert await asyncio.to_thread(wait_until, lambda: _settled(fake), 5.0)
        await asyncio.sleep(0.3)  # the queued request is not started after the close
    assert fake.completed == [] and fake.failed == []
    assert len(fake.calls) == len(fake.aborted) == 1
