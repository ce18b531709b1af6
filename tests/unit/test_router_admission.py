"""Admission control and drain: a burst beyond the limits gets 429s with Retry-After and
nothing else, every admitted request completes, the router holds no state afterwards;
SIGTERM drains (in process, and through uvicorn's signal path)."""

from __future__ import annotations

import asyncio
import signal
import socket
from typing import Any

import httpx
import pytest
import uvicorn
from unit.dispatch_cluster import Cluster
from unit.fake_worker import eventually
from unit.fakes import (
    COMPLETIONS,
    ROUTER_MODEL,
    FakeDispatcher,
    asgi_http_client,
    cmpl_body,
    make_router_app,
    sse_payloads,
)

from pdserve.router.http.edge.admission import Admission
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.edge.drain import DrainingServer
from pdserve.router.http.errors import TooManyRequestsError

BURST = 20


async def test_burst_beyond_limits_gets_429s_and_admitted_requests_complete(
        tokenizer: Any, cluster: Cluster) -> None:
    # Decode waits for the gate: the first two requests run until the whole burst has
    # been answered or queued, however slow the machine. The queue wait covers that.
    gate = cluster.d.script.decode_gate = asyncio.Event()
    edge = EdgeConfig(max_concurrent=2, max_queued=2, max_queue_wait_s=60.0)
    app = make_router_app(tokenizer, cluster.dispatcher, edge, cluster.registry)
    admission = app.state.admission
    most_waiting = 0

    async def watch() -> None:
        nonlocal most_waiting
        while True:
            most_waiting = max(most_waiting, admission.num_waiting)
            assert admission.num_running <= 2
            await asyncio.sleep(0.005)

    watcher = asyncio.create_task(watch())
    async with asgi_http_client(app) as http:
        posts = [asyncio.create_task(http.post(COMPLETIONS, json=cmpl_body(max_tokens=7)))
                 for _ in range(BURST)]
        await eventually(lambda: sum(p.done() for p in posts) == BURST - 4, 30.0,
                         "all but the admitted answered")
        assert (admission.num_running, admission.num_waiting) == (2, 2)
        gate.set()
        replies = await asyncio.gather(*posts)
        watcher.cancel()
        metrics = (await http.get("/metrics")).text
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) == 4  # 2 running + 2 queued, each got its slot in time
    for reply in replies:
        if reply.status_code == 429:
            assert reply.headers["retry-after"] == "1"
            assert reply.json()["error"]["code"] == "too_many_requests"
        else:
            assert reply.json()["choices"][0]["finish_reason"] == "length"
    # Only admitted requests reached a worker; the router holds nothing after the burst.
    assert len([g for g in cluster.d.generates]) == 4
    assert most_waiting == 2
    assert (admission.num_running, admission.num_waiting) == (0, 0)
    assert ('pdserve:http_requests_total{endpoint="/v1/completions",status_code="429"} 16.0'
            in metrics)
    assert f'pdserve:num_requests_running{{model_name="{ROUTER_MODEL}"}} 0.0' in metrics
    # (the cluster fixture checks the workers are idle and no task is left pending)


async def test_a_queued_request_gives_up_after_max_queue_wait() -> None:
    admission = Admission(max_running=1, max_queued=1, max_wait_s=0.05)
    await admission.acquire()
    with pytest.raises(TooManyRequestsError, match="within 0.05 s"):
        await admission.acquire()
    assert admission.num_waiting == 0
    waiter = asyncio.create_task(admission.acquire())  # FIFO: the slot goes to the waiter
    await eventually(lambda: admission.num_waiting == 1)
    admission.release()
    await asyncio.wait_for(waiter, 1.0)
    assert (admission.num_running, admission.num_waiting) == (1, 0)
    admission.release()
    assert await admission.wait_drained(0.1)


async def test_drain_refuses_new_and_queued_requests_and_lets_running_ones_finish(
        tokenizer: Any) -> None:
    gate = asyncio.Event()  # the running request streams until the test sets it
    fake = FakeDispatcher(output_ids=list(range(100, 110)), gate=gate)
    app = make_router_app(tokenizer, fake, EdgeConfig(max_concurrent=1, max_queued=4))
    admission = app.state.admission
    async with asgi_http_client(app) as http:
        running = asyncio.create_task(http.post(COMPLETIONS, json=cmpl_body(stream=True)))
        await eventually(lambda: admission.num_running == 1)
        queued = asyncio.create_task(http.post(COMPLETIONS, json=cmpl_body()))
        await eventually(lambda: admission.num_waiting == 1)
        admission.start_drain()
        for reply in (await queued, await http.post(COMPLETIONS, json=cmpl_body()),
                      await http.get("/health")):
            assert reply.status_code == 503
            assert reply.json()["error"]["code"] == "draining"
        assert not running.done()
        assert not await admission.wait_drained(0.1)  # the drain waits for it
        gate.set()
        assert await admission.wait_drained(5.0)
        reply = await running
    assert reply.status_code == 200
    events = sse_payloads(reply.text)
    assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-1] == "[DONE]"
    assert len(fake.completed) == 1 and fake.aborted == []


async def test_sigterm_drains_the_real_server_then_it_exits(tokenizer: Any) -> None:
    gate = asyncio.Event()  # the stream goes on past its first event until the test sets it
    fake = FakeDispatcher(output_ids=list(range(100, 120)), gate=gate)
    app = make_router_app(tokenizer, fake)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = DrainingServer(uvicorn.Config(app, log_level="warning", lifespan="off"),
                            app.state.admission, drain_timeout_s=60.0)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        await eventually(lambda: server.started, 5.0, "uvicorn started")
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as http:
            async with http.stream("POST", COMPLETIONS, json=cmpl_body(stream=True)) as stream:
                lines = stream.aiter_lines()
                assert (await anext(lines)).startswith("data: ")  # the stream is running
                server.handle_exit(signal.SIGTERM, None)  # what uvicorn's handler calls
                await eventually(lambda: app.state.admission.draining, 2.0, "draining")
                health = await http.get("/health")
                assert health.status_code == 503
                assert health.headers["x-request-id"]
                assert (await http.post(COMPLETIONS, json=cmpl_body())).status_code == 503
                assert not serving.done()  # the drain waits for the stream
                gate.set()
                rest = [line async for line in lines]
        assert "data: [DONE]" in rest and not any("error" in line for line in rest)
        await asyncio.wait_for(serving, 5.0)  # exits by itself once drained
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10.0)
        sock.close()
    assert fake.aborted == [] and len(fake.completed) == 1

