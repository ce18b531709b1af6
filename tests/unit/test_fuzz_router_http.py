"""Bad input on the router's HTTP port (issue 30, part 4), on a real dispatcher over
simulated workers (real gRPC, ``sim_cluster.py``), in process (ASGI): Schemathesis
generates requests from the router's own ``/openapi.json``, and ``http_bodies`` sends
raw bodies (not JSON, cut short, wrong content types, huge numbers, deep nesting).
No response is a 5xx (the workers are healthy: none is documented for that), every
refusal is OpenAI error JSON, nothing is logged as unexpected, and afterwards the
router still serves and holds nothing: admission, the pool's assignments and the
workers' engines all back to 0.

The app, the dispatcher and the workers live on one event loop in a thread of their
own (their gRPC channels belong to it); each test's requests go to it from the test
thread, as a client's would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import threading
from collections import Counter
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from pdserve_testing import wait_until
from schemathesis.checks import negative_data_rejection, positive_data_acceptance
from starlette.testclient import TestClient
from unit.dispatch_cluster import ALWAYS
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ROUTER_MODEL,
    FakeDispatcher,
    cmpl_body,
    default_tokenizer,
    make_router_app,
)
from unit.sim_cluster import SimCluster, sim_cluster

from pdserve.bench.fuzz.http_bodies import CLASSES, RawBody, bodies, is_openai_error

T = TypeVar("T")
MAX_EXAMPLES = 40  # per operation
RAW_PER_PATH = 180  # raw bodies per endpoint, the classes in turn
CONCURRENCY = 32
SIM: dict[str, Any] = {"decode_s_per_token": 0.0, "step_overhead_s": 0.0,
                       "prefill_s_per_token": 0.0}
# The same routes as the fuzzed app: the schema is read once, at collection.
SCHEMA = schemathesis.openapi.from_dict(
    make_router_app(default_tokenizer(), FakeDispatcher()).openapi())
# positive_data_acceptance wants a 2xx for every body the schema allows; the schema cannot
# say what the router checks against its model (name, context, vocabulary): documented 400s.
# negative_data_rejection wants a 4xx for every body it does not allow; the router reads
# requests in pydantic's lax mode, as vLLM's server does ("prompt": [false] is token 0).
_EXCLUDED = [positive_data_acceptance, negative_data_rejection]


class _Loop:
    """An event loop running in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class _Unexpected(logging.Handler):
    """Every ERROR the router logs (its error handler logs unexpected exceptions so)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@dataclass
class Router:
    loop: _Loop
    app: Any
    cluster: SimCluster
    http: httpx.AsyncClient
    errors: _Unexpected

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self.loop.run(self.http.request(method, url, **kwargs))

    def holds_nothing(self) -> bool:
        admission = self.app.state.admission
        pool = self.cluster.pool
        assert pool is not None
        workers = [*pool.prefill, *pool.decode]
        return ((admission.num_running, admission.num_waiting) == (0, 0)
                and all(w.snapshot().num_assigned == 0 for w in workers)
                and all((e.counters.num_running_reqs, e.counters.num_waiting_reqs) == (0, 0)
                        for e in self.cluster.engines.values()))


@pytest.fixture(scope="module")
def router() -> Iterator[Router]:
    loop = _Loop()
    stack = contextlib.AsyncExitStack()
    cluster = loop.run(stack.enter_async_context(
        sim_cluster([("p0", "prefill"), ("d0", "decode")], ALWAYS, **SIM)))
    app = make_router_app(default_tokenizer(), cluster.dispatcher, registry=cluster.registry)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    errors = _Unexpected()
    logging.getLogger("pdserve.router").addHandler(errors)
    try:
        yield Router(loop, app, cluster, http, errors)
    finally:
        logging.getLogger("pdserve.router").removeHandler(errors)
        loop.run(http.aclose())
        loop.run(stack.aclose())
        loop.close()


def _send(router: Router, case: schemathesis.Case) -> httpx.Response:
    kwargs = case.as_transport_kwargs(base_url="http://test")
    body = {"json": kwargs["json"]} if "json" in kwargs else (
        {"content": kwargs["data"]} if isinstance(kwargs.get("data"), bytes | str) else {})
    return router.request(kwargs["method"], kwargs["url"], headers=kwargs.get("headers"),
                          params=kwargs.get("params"), cookies=kwargs.get("cookies"), **body)


def _check(response: httpx.Response, what: object) -> None:
    assert response.status_code < 500, (what, response.status_code, response.text[:500])
    if response.status_code >= 400:
        assert is_openai_error(response.json()), (what, response.text[:500])


@SCHEMA.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_schemathesis_finds_no_5xx_and_only_openai_errors(
        case: schemathesis.Case, router: Router) -> None:
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = ROUTER_MODEL  # else every body is a 404 and none is served
    response = _send(router, case)
    _check(response, case)
    case.validate_response(response, excluded_checks=_EXCLUDED)


def test_raw_bodies_are_refused_with_openai_errors(router: Router) -> None:
    """Sent ``CONCURRENCY`` at a time: the valid ones among them are served (and queue in
    admission) while the bad ones are refused."""
    raws = bodies(random.Random(5), ROUTER_MODEL, RAW_PER_PATH)

    async def send(raw: RawBody) -> httpx.Response:
        headers = {} if raw.content_type is None else {"content-type": raw.content_type}
        return await router.http.post(raw.path, content=raw.content, headers=headers)

    async def send_all() -> list[httpx.Response]:
        out: list[httpx.Response] = []
        for start in range(0, len(raws), CONCURRENCY):
            out += await asyncio.gather(*map(send, raws[start:start + CONCURRENCY]))
        return out

    statuses: Counter[tuple[str, int]] = Counter()
    for raw, response in zip(raws, router.loop.run(send_all()), strict=True):
        _check(response, raw)
        if raw.cls == "valid":
            assert response.status_code == 200, (raw, response.text[:300])
        if response.status_code == 200 and "event-stream" in response.headers["content-type"]:
            assert response.text.rstrip().endswith("data: [DONE]"), raw
        statuses[raw.cls, response.status_code] += 1
    assert {cls for cls, _ in statuses} == set(CLASSES)
    bad = sum(n for (cls, _), n in statuses.items() if cls != "valid")
    refused = sum(n for (cls, status), n in statuses.items() if cls != "valid" and status == 400)
    assert refused > 0.8 * bad, statuses


def test_after_the_fuzz_the_router_serves_and_holds_nothing(router: Router) -> None:
    reply = router.request("POST", COMPLETIONS, json=cmpl_body(max_tokens=4))
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert wait_until(router.holds_nothing, timeout_s=5.0), "a fuzzed request left work held"
    served = [e.counters.prompt_tokens_computed for e in router.cluster.engines.values()]
    assert sum(served) > 0  # the fuzz reached the workers, not only the edge
    assert router.errors.records == [], router.errors.records[:5]


@pytest.mark.parametrize(("path", "fields", "param"), [
    (COMPLETIONS, {"prompt": "h\ud800i"}, "prompt"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": "h\udfffi"}]}, "messages"),
    (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\ud800"}]}]}, "messages"),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": "a\ud800"}, "cache_salt"),
])
def test_a_lone_surrogate_is_a_400_not_a_tokenizer_500(
        path: str, fields: dict[str, Any], param: str) -> None:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); it reached the tokenizer (a
    TypeError: 500) or the salt's hash (a UnicodeEncodeError: 500)."""
    fake = FakeDispatcher(output_ids=[1, 2])
    with TestClient(make_router_app(default_tokenizer(), fake)) as client:
        reply = client.post(path, content=json.dumps({"model": ROUTER_MODEL, **fields}),
                            headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param
    assert fake.calls == []
