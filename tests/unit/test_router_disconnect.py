"""Client disconnects abort the request on the workers: the dispatcher's chunk iterator is
closed, on a real uvicorn server and at the ASGI level."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator, MutableMapping
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    FakeDispatcher,
    chat_body,
    cmpl_body,
    make_router_app,
    serve_in_thread,
    wait_until,
)


@pytest.fixture()
def slow_server(tokenizer: Any) -> Iterator[tuple[str, FakeDispatcher, FastAPI]]:
    """A live server whose dispatcher would need ~50 s to finish a request."""
    fake = FakeDispatcher(output_ids=[28120] * 1000, delay_s=0.05)
    app = make_router_app(tokenizer, fake)
    with serve_in_thread(app) as base_url:
        yield base_url, fake, app


def in_flight(app: FastAPI) -> float:
    return app.state.metrics.requests_in_flight._value.get()


def test_client_disconnect_mid_stream_aborts(
    slow_server: tuple[str, FakeDispatcher, FastAPI],
) -> None:
    base_url, fake, app = slow_server
    body = cmpl_body(max_tokens=200, stream=True)
    with httpx.Client(base_url=base_url, timeout=5.0) as client:
        with client.stream("POST", COMPLETIONS, json=body) as response:
            assert response.status_code == 200
            events: list[str] = []
            for line in response.iter_lines():
                if line.startswith("data:"):
                    events.append(line)
                    if len(events) == 2:
                        break
    assert len(events) == 2
    assert wait_until(lambda: len(fake.aborted) == 1, timeout_s=5.0), fake
    assert fake.completed == [] and fake.failed == []
    assert wait_until(lambda: in_flight(app) == 0, timeout_s=5.0)


def test_client_disconnect_while_waiting_aborts(
    slow_server: tuple[str, FakeDispatcher, FastAPI],
) -> None:
    base_url, fake, app = slow_server
    with httpx.Client(base_url=base_url, timeout=0.3) as client:
        with pytest.raises(httpx.ReadTimeout):
            client.post(CHAT_COMPLETIONS, json=chat_body(max_tokens=200))
    assert wait_until(lambda: len(fake.aborted) == 1, timeout_s=5.0), fake
    assert wait_until(lambda: in_flight(app) == 0, timeout_s=5.0)


async def test_disconnect_while_sending_closes_the_stream_at_once(tokenizer: Any) -> None:
    """The client goes away while a write is stuck (full socket buffer): Starlette cancels
    the writer with the SSE generator suspended at a ``yield``; it must still be closed."""
    fake = FakeDispatcher(output_ids=[28120] * 50)
    app = make_router_app(tokenizer, fake)
    request_body = json.dumps(cmpl_body(stream=True, max_tokens=50)).encode()
    incoming = [{"type": "http.request", "body": request_body, "more_body": False}]
    disconnected = asyncio.Event()
    num_body_writes = 0

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        nonlocal num_body_writes
        if message["type"] == "http.response.body":
            num_body_writes += 1
            if num_body_writes == 2:
                disconnected.set()
                await asyncio.Event().wait()  # the stuck write; only cancellation ends it

    await asyncio.wait_for(app(asgi_scope("POST", COMPLETIONS), receive, send), timeout=5.0)
    assert fake.aborted == [fake.calls[0].request_id]


def asgi_scope(method: str, path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 50000),
        "server": ("test", 80),
    }
