"""One deadline per request, end to end: fixed at arrival (``--request-timeout-s``,
shortened by ``X-Request-Timeout``), each worker call gets what is left of it as its gRPC
deadline, and past it the client gets 504 (or an error event, then ``[DONE]``) while
both workers have the request cancelled and its KV freed. Real router app and
dispatcher, fake workers over real gRPC (``fake_worker.py``); the ``cluster`` fixture
checks that nothing is left in flight."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi import FastAPI
from unit.dispatch_cluster import PROMPT, Cluster, collect, spec
from unit.fake_worker import eventually
from unit.fakes import (
    COMPLETIONS,
    ROUTER_MAX_MODEL_LEN,
    ROUTER_MODEL,
    asgi_http_client,
    cmpl_body,
    sse_payloads,
)

from pdserve.router.dispatch.base import Deadline, DeadlineExceededError
from pdserve.router.http.app import create_app

MAX_TIMEOUT_S = 30.0
DEADLINES = "pdserve:deadline_exceeded_total"
# gRPC sends a deadline as a timeout header rounded up to a few significant digits (up
# to 100 ms at 10 s, whatever the clock reads in between): the worker may see ~1% more.
WIRE_SLACK_S = 0.11
# The X-Request-Timeout of the tests that run past it: long enough for the prefill (and
# its token, streamed) to be done in time on a slow machine, far short of slow_decode.
SHORT_TIMEOUT_S = 2.0
# What may pass on a slow, loaded machine between a request's arrival and a worker
# call (tokenization, placement, gRPC): the deadline it gets is at most this much less.
ROUTER_SLACK_S = 2.0


def router_app(cluster: Cluster, tokenizer: Any, max_timeout_s: float = MAX_TIMEOUT_S
               ) -> FastAPI:
    return create_app(served_model_name=ROUTER_MODEL, max_model_len=ROUTER_MAX_MODEL_LEN,
                      tokenizer=tokenizer, dispatcher=cluster.dispatcher,
                      registry=cluster.registry, request_timeout_s=max_timeout_s)


def slow_decode(cluster: Cluster) -> None:
    """Eight tokens, 5 s apart: 40 s, far past the tests' ``SHORT_TIMEOUT_S``; not even
    decode's first token comes before it."""
    cluster.d.script.token_delay_s = 5.0


async def assert_cancelled_on_both(cluster: Cluster) -> None:
    """Decode's call was cancelled (its deadline passed) and prefill's KV released."""
    (call,) = cluster.d.generates
    rid = call.request_id
    await eventually(lambda: cluster.d.cancelled == [rid], 3.0, "decode call cancelled")
    await eventually(lambda: rid in cluster.p.aborts and not cluster.p.leases, 3.0,
                     "prefill's KV lease released")


def requests_with(app: FastAPI, status: int) -> float:
    metric = app.state.metrics.requests.labels(COMPLETIONS, str(status))
    return metric._value.get()


async def test_a_short_x_request_timeout_gets_504_and_aborts_both_workers(
    cluster: Cluster, tokenizer: Any
) -> None:
    slow_decode(cluster)
    app = router_app(cluster, tokenizer)
    started = time.perf_counter()
    async with asgi_http_client(app) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(max_tokens=8),
                                     headers={"X-Request-Timeout": f"{SHORT_TIMEOUT_S:g}"})
    # Ended by the 2 s X-Request-Timeout, not by the 30 s --request-timeout-s or the 40 s
    # decode (the message below names which deadline it was).
    assert time.perf_counter() - started < MAX_TIMEOUT_S / 2
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("timeout_error", "timeout")
    assert f"({SHORT_TIMEOUT_S:g} s)" in error["message"]
    await assert_cancelled_on_both(cluster)
    assert requests_with(app, 504) == 1
    assert cluster.registry.get_sample_value(DEADLINES, {"phase": "decode"}) == 1


async def test_a_stream_past_its_deadline_ends_with_an_error_event_then_done(
    cluster: Cluster, tokenizer: Any
) -> None:
    slow_decode(cluster)
    app = router_app(cluster, tokenizer)
    async with asgi_http_client(app) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(max_tokens=8, stream=True),
                                     headers={"X-Request-Timeout": f"{SHORT_TIMEOUT_S:g}"})
    assert response.status_code == 200  # the first token (prefill's) was sent at once
    payloads = sse_payloads(response.text)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["error"]["code"] == "timeout"
    assert all("choices" in p for p in payloads[:-2]) and len(payloads) >= 3
    await assert_cancelled_on_both(cluster)


async def test_each_worker_call_gets_what_is_left_of_one_deadline(
    cluster: Cluster, tokenizer: Any
) -> None:
    cluster.p.script.prefill_delay_s = 0.3
    app = router_app(cluster, tokenizer)
    async with asgi_http_client(app) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(max_tokens=4),
                                     headers={"X-Request-Timeout": "5"})
    assert response.status_code == 200, response.text
    (prefill,), (decode,) = cluster.p.generates, cluster.d.generates
    assert prefill.timeout_s is not None and decode.timeout_s is not None
    assert 5.0 - ROUTER_SLACK_S < prefill.timeout_s <= 5.0 + WIRE_SLACK_S
    # Decode's deadline is the same instant: prefill's 0.3 s are gone from it.
    assert decode.timeout_s <= prefill.timeout_s - 0.3 + WIRE_SLACK_S


async def test_the_header_cannot_exceed_the_configured_timeout(
    cluster: Cluster, tokenizer: Any
) -> None:
    configured_s = 10.0  # each request must finish within it, on a slow machine too
    app = router_app(cluster, tokenizer, max_timeout_s=configured_s)
    async with asgi_http_client(app) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(max_tokens=2),
                                     headers={"X-Request-Timeout": "3600"})
        assert response.status_code == 200, response.text
        assert cluster.p.generates[0].timeout_s is not None
        assert cluster.p.generates[0].timeout_s <= configured_s + WIRE_SLACK_S
        response = await client.post(COMPLETIONS, json=cmpl_body(max_tokens=2))
    assert response.status_code == 200, response.text
    # No header: the configured timeout.
    assert (configured_s - ROUTER_SLACK_S < (cluster.p.generates[1].timeout_s or 0)
            <= configured_s + WIRE_SLACK_S)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf", ""])
async def test_a_bad_x_request_timeout_is_400_before_any_worker_call(
    cluster: Cluster, tokenizer: Any, value: str
) -> None:
    app = router_app(cluster, tokenizer)
    async with asgi_http_client(app) as client:
        response = await client.post(COMPLETIONS, json=cmpl_body(),
                                     headers={"X-Request-Timeout": value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", "X-Request-Timeout")
    assert cluster.p.generates == [] and cluster.d.generates == []


async def test_a_prefill_past_the_deadline_does_not_fall_back_to_decode(
    cluster: Cluster,
) -> None:
    cluster.p.script.prefill_delay_s = 5.0
    chunks = cluster.dispatcher.generate("r-late", PROMPT, spec(4), deadline=Deadline.after(0.3))
    with pytest.raises(DeadlineExceededError, match="prefill"):
        await collect(chunks)
    await eventually(lambda: cluster.p.cancelled == ["r-late"], 3.0, "prefill call cancelled")
    assert cluster.d.generates == []  # no time left for decode to compute the prompt
    assert cluster.fallbacks() == 0
    assert cluster.registry.get_sample_value(DEADLINES, {"phase": "prefill"}) == 1
