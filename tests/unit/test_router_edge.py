"""The router's HTTP edge: body limit (413), protobuf range checks (400), request ids
(echoed, passed to the workers, in log lines), and a stream failing midway counted as
failed by its reason."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
from unit.dispatch_cluster import Cluster
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ROUTER_MODEL,
    FakeDispatcher,
    asgi_http_client,
    chat_body,
    cmpl_body,
    make_router_app,
    sse_payloads,
)

from pdserve.core.logs import make_handler
from pdserve.router.http.edge.config import EdgeConfig

OUTPUT = list(range(100, 108))


# --- body limit --------------------------------------------------------------------------


async def test_body_over_the_limit_is_413_by_length_and_by_count(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT)
    app = make_router_app(tokenizer, fake, EdgeConfig(max_body_bytes=1000))
    big = json.dumps(cmpl_body(prompt="x" * 2000)).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: counted as read
        for start in range(0, len(big), 100):
            yield big[start:start + 100]

    async with asgi_http_client(app) as http:
        by_length = await http.post(COMPLETIONS, content=big,
                                    headers={"content-type": "application/json"})
        by_count = await http.post(COMPLETIONS, content=chunked(),
                                   headers={"content-type": "application/json"})
        small = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=2))
        metrics = (await http.get("/metrics")).text
    for reply in (by_length, by_count):
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "request_too_large"
        assert reply.headers["x-request-id"]
    assert "content-length" not in {k.lower() for k in by_count.request.headers}
    assert small.status_code == 200
    assert len(fake.calls) == 1
    assert ('pdserve:http_requests_total{endpoint="/v1/completions",status_code="413"} 2.0'
            in metrics)


# --- range checks: every number that reaches protobuf ------------------------------------


@pytest.mark.parametrize(("field", "value"), [
    ("top_k", 2**31), ("seed", 2**63), ("seed", -(2**63) - 1), ("max_tokens", 2**32),
    ("max_tokens", 0), ("n", 0), ("logprobs", 21), ("presence_penalty", 5),
    ("min_tokens", -1), ("n", 129), ("temperature", 3),
    ("top_p", 0), ("best_of", 2**70), ("max_tokens", 1.5), ("seed", "7x")])
async def test_out_of_range_numbers_are_400_naming_the_field(
        tokenizer: Any, field: str, value: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT)
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        for path, body in ((COMPLETIONS, cmpl_body(**{field: value})),
                           (CHAT_COMPLETIONS, chat_body(**{field: value}))):
            reply = await http.post(path, json=body)
            assert reply.status_code == 400, (path, reply.text)
            error = reply.json()["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", field)
    assert fake.calls == []


async def test_chat_max_completion_tokens_beyond_uint32_is_400(tokenizer: Any) -> None:
    async with asgi_http_client(make_router_app(tokenizer, FakeDispatcher())) as http:
        reply = await http.post(CHAT_COMPLETIONS, json=chat_body(max_completion_tokens=2**32))
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "max_completion_tokens"


async def test_the_largest_values_in_range_go_through_protobuf_to_the_workers(
        tokenizer: Any, cluster: Cluster) -> None:
    app = make_router_app(tokenizer, cluster.dispatcher, registry=cluster.registry)
    async with asgi_http_client(app) as http:
        for seed in (2**63 - 1, -(2**63)):
            reply = await http.post(COMPLETIONS, json=cmpl_body(
                max_tokens=3, top_k=2**31 - 1, seed=seed, temperature=2, top_p=1))
            assert reply.status_code == 200, reply.text
    assert [g.phase for g in cluster.d.generates] == ["decode", "decode"]


# --- request ids -------------------------------------------------------------------------


async def test_client_request_id_is_echoed_and_the_workers_id_adds_128_random_bits(
        tokenizer: Any, cluster: Cluster) -> None:
    app = make_router_app(tokenizer, cluster.dispatcher, registry=cluster.registry)
    async with asgi_http_client(app) as http:
        plain = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=3),
                                headers={"X-Request-Id": "client-abc.123"})
        stream = await http.post(CHAT_COMPLETIONS, json=chat_body(max_tokens=3, stream=True),
                                 headers={"X-Request-Id": "client-def"})
        generated = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=3))
        error = await http.post(COMPLETIONS, json=cmpl_body(model="nope"),
                                headers={"X-Request-Id": "client-err"})
    assert plain.headers["x-request-id"] == "client-abc.123"
    assert plain.json()["id"] == "cmpl-client-abc.123"
    assert stream.headers["x-request-id"] == "client-def"
    assert sse_payloads(stream.text)[0]["id"] == "chatcmpl-client-def"
    assert error.status_code == 404 and error.headers["x-request-id"] == "client-err"
    own = generated.headers["x-request-id"]
    assert len(own) == 32 and generated.json()["id"] == f"cmpl-{own}"
    sent = [(g.phase, g.request_id) for g in cluster.p.generates + cluster.d.generates]
    by_id: dict[str, set[str]] = {}
    for phase, rid in sent:
        visible, dot, suffix = rid.rpartition(".")
        assert dot and len(suffix) == 32 and int(suffix, 16) >= 0  # 128 random bits
        by_id.setdefault(visible, set()).add(phase)
    assert by_id == {rid: {"prefill", "decode"} for rid in
                     ("cmpl-client-abc.123", "chatcmpl-client-def", f"cmpl-{own}")}
    assert len({rid for _, rid in sent}) == 3  # prefill and decode of one request: one id


@pytest.mark.parametrize("bad", ["has space", "x" * 129, "tab\there", "ünïcode"])
async def test_unusable_request_id_is_400(tokenizer: Any, bad: str) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT)
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        reply = await http.post(COMPLETIONS, json=cmpl_body(),
                                headers={b"X-Request-Id": bad.encode("utf-8")})
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "invalid_request_id"
    assert reply.headers["x-request-id"] != bad and fake.calls == []


async def test_one_client_id_twice_at_once_is_two_requests_on_the_workers(
        tokenizer: Any) -> None:
    """A client id is a label: a second request with a running one's id (another
    tenant's, say) runs as a request of its own, and learns nothing of the first."""
    import asyncio

    gate = asyncio.Event()  # the first request runs until the second has been answered
    fake = FakeDispatcher(output_ids=OUTPUT, gate=gate)
    app = make_router_app(tokenizer, fake)
    async with asgi_http_client(app) as http:
        first = asyncio.create_task(http.post(COMPLETIONS, json=cmpl_body(),
                                              headers={"X-Request-Id": "same"}))
        while not fake.calls:
            await asyncio.sleep(0.01)
        second = asyncio.create_task(http.post(COMPLETIONS, json=cmpl_body(),
                                               headers={"X-Request-Id": "same"}))
        while len(fake.calls) < 2:
            await asyncio.sleep(0.01)
        assert not first.done() and not second.done()  # both run at once
        gate.set()
        replies = [await first, await second]
    assert [r.status_code for r in replies] == [200, 200]
    assert [r.json()["id"] for r in replies] == ["cmpl-same", "cmpl-same"]
    worker_ids = [call.request_id for call in fake.calls]
    assert len(set(worker_ids)) == 2 and all(i.startswith("cmpl-same.") for i in worker_ids)


async def test_log_lines_about_a_request_carry_its_id(tokenizer: Any) -> None:
    out = io.StringIO()
    handler = make_handler("json", out)
    logger = logging.getLogger("pdserve")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    fake = FakeDispatcher(output_ids=OUTPUT, fail_after_chunks=1)
    try:
        async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
            await http.post(COMPLETIONS, json=cmpl_body(), headers={"X-Request-Id": "log-me"})
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    about = [line for line in lines if "log-me" in line["message"]]
    assert about and all(line["request_id"] == "log-me" for line in about)
    assert any("status=500" in line["message"] for line in about)


# --- a stream that fails midway ----------------------------------------------------------


async def test_stream_failing_midway_counts_as_failed_not_200(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=OUTPUT, fail_after_chunks=3)
    app = make_router_app(tokenizer, fake)
    async with asgi_http_client(app) as http:
        reply = await http.post(COMPLETIONS, json=cmpl_body(stream=True))
        metrics = (await http.get("/metrics")).text
    assert reply.status_code == 200  # the stream had started
    assert sse_payloads(reply.text)[-2]["error"]["code"] == "worker_failed"
    assert ('pdserve:http_requests_total{endpoint="/v1/completions",status_code="200"} 0.0'
            in metrics)
    assert ('pdserve:http_requests_total{endpoint="/v1/completions",status_code="500"} 1.0'
            in metrics)
    assert ('pdserve:request_failures_total{endpoint="/v1/completions",'
            'reason="worker_failed"} 1.0' in metrics)
    assert (f'pdserve:e2e_request_latency_seconds_count{{model_name="{ROUTER_MODEL}"}} 0.0'
            in metrics)
