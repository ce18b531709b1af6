"""Per-tenant limits and accounting: the token bucket and the concurrency count on an
injected clock (``router/http/tenants/limits.py``), then the router app on the real
dispatcher and fake gRPC workers: a tenant over a limit gets 429 with ``Retry-After``
while another tenant's requests all succeed, and the ``pdserve:tenant_*`` counters say
who spent what; and the express lane of a real uvicorn server is counted too."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import httpx
import pytest
from prometheus_client import generate_latest
from unit.dispatch_cluster import Cluster
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    Clock,
    FakeDispatcher,
    chat_body,
    cmpl_body,
    make_router_app,
    serve_in_thread,
    sse_payloads,
)

from pdserve.core.types import SamplingSpec
from pdserve.router.dispatch.base import Dispatcher, TokenChunk
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.tenants.limits import TenantLimiter, TokenBucket
from pdserve.router.http.tenants.table import TenantLimits, TenantSpec


def test_the_bucket_admits_until_in_debt_and_retry_after_is_the_time_to_repay() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(tokens_per_s=10.0, burst=30.0), clock)
    assert limiter.level() == 30.0
    assert limiter.acquire() is None
    limiter.charge(25)  # a prompt
    assert limiter.acquire() is None  # 5 left: not in debt
    limiter.charge(40)  # its completion: 35 in debt
    refusal = limiter.acquire()
    assert refusal is not None and (refusal.reason, refusal.retry_after_s) == ("tokens", 4)
    clock.now += 3.4  # 1 in debt: at least a second
    assert (refusal := limiter.acquire()) is not None and refusal.retry_after_s == 1
    clock.now += 0.1
    assert limiter.acquire() is None  # out of debt
    clock.now += 1000.0
    assert limiter.level() == 30.0  # never more than the burst
    clock.now -= 5.0  # a clock that went back refills nothing
    assert limiter.level() == 30.0
    assert limiter.num_running == 3


def test_the_default_burst_is_one_second_and_a_long_prompt_is_admitted_then_repaid() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=2.0, capacity=TenantLimits(tokens_per_s=2.0).capacity,
                         now=clock.now)
    assert bucket.level(clock.now) == 2.0 and bucket.retry_after_s(clock.now) == 0
    bucket.charge(1001, clock.now)  # far beyond the bucket: admitted, then repaid
    assert bucket.retry_after_s(clock.now) == math.ceil(999 / 2.0)


def test_concurrency_is_counted_and_the_token_limit_is_reported_first() -> None:
    clock = Clock()
    limiter = TenantLimiter(TenantLimits(max_concurrent=2, tokens_per_s=1.0), clock)
    assert limiter.acquire() is None and limiter.acquire() is None
    refusal = limiter.acquire()
    assert refusal is not None and (refusal.reason, refusal.retry_after_s) == ("concurrency", 1)
    limiter.release()
    assert limiter.acquire() is None
    limiter.charge(10)
    refusal = limiter.acquire()  # over both: the longer wait is the one to report
    assert refusal is not None and (refusal.reason, refusal.retry_after_s) == ("tokens", 9)
    unlimited = TenantLimiter(TenantLimits(max_concurrent=1000), clock)
    unlimited.charge(10**9)  # no token limit: nothing to owe
    assert unlimited.acquire() is None and unlimited.level() is None


# ---- the router app -------------------------------------------------------------------

KEYS = {"acme": "sk-acme-key-000001", "thrift": "sk-thrift-key-0002",
        "beta": "sk-beta-key-000003", "beta2": "sk-beta-key-000004"}
LONE = "sk-lone-key-000005"  # no tenant name: key-5
EDGE = EdgeConfig(
    api_keys=(*KEYS.values(), LONE), tenant_isolation="key",
    tenants=(TenantSpec("acme", (KEYS["acme"],), TenantLimits(max_concurrent=1)),
             TenantSpec("thrift", (KEYS["thrift"],), TenantLimits(tokens_per_s=0.01)),
             # Limits it stays under: its own state, untouched by the others'.
             TenantSpec("beta", (KEYS["beta"], KEYS["beta2"]),
                        TenantLimits(max_concurrent=8, tokens_per_s=1e6))))
TENANTS = ("acme", "thrift", "beta", "key-5")
PROMPT = "The quick brown fox jumps over the lazy dog"
CACHED = 4  # what the fake prefill worker reports as cached
SERIES = ("requests", "prompt_tokens", "cached_tokens", "completion_tokens")


class HoldingDispatcher:
    """The cluster's dispatcher, but a request whose id has ``held`` in it stops after its
    first chunk until ``release`` is set."""

    def __init__(self, inner: Dispatcher) -> None:
        self.inner = inner
        self.release = asyncio.Event()
        self.held_started = asyncio.Event()

    def is_ready(self) -> bool:
        return self.inner.is_ready()

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingSpec, *args: Any, **kwargs: Any
                 ) -> AsyncGenerator[TokenChunk, None]:
        chunks = self.inner.generate(request_id, prompt_token_ids, sampling, *args, **kwargs)
        return self._held(chunks) if "held" in request_id else chunks

    async def _held(self, chunks: AsyncGenerator[TokenChunk, None]
                    ) -> AsyncGenerator[TokenChunk, None]:
        async with contextlib.aclosing(chunks):
            yield await anext(chunks)
            self.held_started.set()
            await asyncio.wait_for(self.release.wait(), 10.0)
            async for chunk in chunks:
                yield chunk


def counters(app: Any) -> dict[tuple[str, str], float]:
    registry = app.state.registry
    found = {(t, s): registry.get_sample_value(f"pdserve:tenant_{s}_total", {"tenant": t})
             for t in TENANTS for s in SERIES}
    found |= {(t, f"rejected_{why}"): registry.get_sample_value(
        "pdserve:tenant_rejections_total", {"tenant": t, "reason": why})
        for t in TENANTS for why in ("concurrency", "tokens")}
    assert None not in found.values(), found  # every series exported from the start
    return found


def usage_of(reply: httpx.Response, stream: bool) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    body = sse_payloads(reply.text)[-2] if stream else reply.json()
    return dict(body["usage"])


def assert_rate_limited(reply: httpx.Response, tenant: str, retry_after: int | range) -> None:
    assert reply.status_code == 429, reply.text
    wait = int(reply.headers["retry-after"])
    assert wait == retry_after if isinstance(retry_after, int) else wait in retry_after
    error = reply.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "rate_limit_exceeded"
    assert error["param"] is None and f"Tenant {tenant} " in error["message"]


def bearer(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS.get(tenant, LONE)}"}


async def test_a_tenant_over_its_limit_gets_429_while_another_tenants_requests_all_succeed(
        tokenizer: Any, cluster: Cluster) -> None:
    cluster.p.script.num_cached_tokens = CACHED
    dispatcher = HoldingDispatcher(cluster.dispatcher)
    app = make_router_app(tokenizer, dispatcher, EDGE, cluster.registry)
    before = counters(app)
    stream = {"stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test", timeout=10.0) as http:
        def post(tenant: str, path: str, body: dict[str, Any], **headers: str
                 ) -> Any:
            return http.post(path, json=body, headers={**bearer(tenant), **headers})

        # acme's one request runs (held after its first token) ...
        held = asyncio.create_task(post("acme", COMPLETIONS, cmpl_body(
            prompt=PROMPT, max_tokens=5), **{"X-Request-Id": "held-acme"}))
        await asyncio.wait_for(dispatcher.held_started.wait(), 10.0)
        # ... so its next one, streaming or not, is over its max_concurrent.
        for body in (cmpl_body(prompt=PROMPT, **stream), chat_body()):
            path = COMPLETIONS if "prompt" in body else CHAT_COMPLETIONS
            assert_rate_limited(await post("acme", path, body), "acme", 1)
        # thrift's first request runs and leaves it in debt: its next one waits for it.
        spent = usage_of(await post("thrift", COMPLETIONS,
                                    cmpl_body(prompt=PROMPT, max_tokens=3, **stream)), True)
        debt_s = spent["total_tokens"] / 0.01
        assert_rate_limited(await post("thrift", CHAT_COMPLETIONS, chat_body(**stream)),
                            "thrift", range(math.ceil(debt_s - 20), math.ceil(debt_s) + 1))
        # Meanwhile beta (two keys, one tenant) and the lone key: every request succeeds,
        # chat and completions, streaming or not, all at once.
        asks = [(tenant, path, body, is_stream)
                for tenant in ("beta", "beta2", "lone")
                for path, body in ((COMPLETIONS, cmpl_body(prompt=PROMPT, max_tokens=4)),
                                   (CHAT_COMPLETIONS, chat_body(max_tokens=6)))
                for is_stream in (False, True)]
        replies = await asyncio.gather(*(
            post(tenant, path, {**body, **(stream if is_stream else {})})
            for tenant, path, body, is_stream in asks))
        usages = [usage_of(reply, ask[3]) for reply, ask in zip(replies, asks, strict=True)]
        acme = next(a for a in app.state.tenants.values() if a.name == "acme")
        assert acme.limiter.num_running == 1
        dispatcher.release.set()
        held_usage = usage_of(await held, False)
    after = counters(app)
    grew = {k: after[k] - before[k] for k in after if after[k] != before[k]}

    def spent_by(items: list[dict[str, Any]]) -> dict[str, float]:
        return {"prompt_tokens": sum(u["prompt_tokens"] for u in items),
                "completion_tokens": sum(u["completion_tokens"] for u in items),
                "cached_tokens": sum(u["prompt_tokens_details"]["cached_tokens"]
                                     for u in items)}

    beta = spent_by(usages[:8])
    lone = spent_by(usages[8:])
    assert beta["cached_tokens"] == 8 * CACHED
    expected = {("acme", "requests"): 3, ("acme", "rejected_concurrency"): 2,
                ("thrift", "requests"): 2, ("thrift", "rejected_tokens"): 1,
                ("beta", "requests"): 8, ("key-5", "requests"): 4,
                **{("acme", k): v for k, v in spent_by([held_usage]).items()},
                **{("thrift", k): v for k, v in spent_by([spent]).items()},
                **{("beta", k): v for k, v in beta.items()},
                **{("key-5", k): v for k, v in lone.items()}}
    assert grew == expected
    # Nothing held: every tenant's slots and the global admission are free again.
    assert all(a.limiter is None or a.limiter.num_running == 0
               for a in app.state.tenants.values())
    assert app.state.admission.num_running == 0 and app.state.admission.num_waiting == 0


async def test_the_counters_label_configured_tenants_only_and_never_a_key(
        tokenizer: Any) -> None:
    app = make_router_app(tokenizer, FakeDispatcher(output_ids=[5, 6]), EDGE)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        refused = await http.post(COMPLETIONS, json=cmpl_body(),
                                  headers={"Authorization": "Bearer sk-unknown-key-999"})
        assert refused.status_code == 401
    text = generate_latest(app.state.registry).decode()  # the admin plane's /metrics
    tenants = {line.split('tenant="')[1].split('"')[0]
               for line in text.splitlines() if line.startswith("pdserve:tenant_")}
    assert tenants == set(TENANTS)
    assert not any(key in text or key[:8] in text
                   for key in (*KEYS.values(), LONE, "sk-unknown-key-999"))


def test_the_express_lane_of_a_real_server_is_counted_and_limited(tokenizer: Any) -> None:
    """Through uvicorn a stream's plain chunks are written by the express lane, past the
    body's loop: the tenant is still charged for every token."""
    num_tokens = 200
    fake = FakeDispatcher(output_ids=tokenizer.encode(" fox" * num_tokens)[:num_tokens])
    limits = TenantLimits(tokens_per_s=1.0, burst=float(num_tokens))
    edge = EdgeConfig(api_keys=(LONE,), tenants=(TenantSpec("solo", (LONE,), limits),))
    app = make_router_app(tokenizer, fake, edge)
    body = cmpl_body(prompt=PROMPT, max_tokens=num_tokens, stream=True)
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=10.0) as http:
        first = http.post(COMPLETIONS, json=body, headers=bearer("lone"))
        # No wait: the completion is charged before the response's last bytes are sent,
        # so the next request, sent as soon as the first is read, is refused.
        second = http.post(COMPLETIONS, content=json.dumps(body),
                           headers={**bearer("lone"), "content-type": "application/json"})
    assert first.status_code == 200 and sse_payloads(first.text)[-1] == "[DONE]"
    assert 0 < fake.express_taken < num_tokens
    registry = app.state.registry
    assert registry.get_sample_value("pdserve:tenant_completion_tokens_total",
                                     {"tenant": "solo"}) == num_tokens
    prompt = registry.get_sample_value("pdserve:tenant_prompt_tokens_total",
                                       {"tenant": "solo"})
    assert prompt is not None and prompt > 0
    # The prompt and the 200 tokens took the bucket of 200 into debt by the prompt's
    # tokens: as many seconds to wait at 1 token per second, less the stream's time.
    assert_rate_limited(second, "solo", range(math.ceil(prompt) - 5, math.ceil(prompt) + 1))
    assert registry.get_sample_value("pdserve:tenant_rejections_total",
                                     {"tenant": "solo", "reason": "tokens"}) == 1


@pytest.mark.parametrize("isolation", ["off", "key"])
async def test_keys_of_one_tenant_share_its_salt_and_a_lone_key_keeps_its_own(
        tokenizer: Any, isolation: str) -> None:
    dispatcher = FakeDispatcher(output_ids=[5, 6])
    edge = EdgeConfig(api_keys=EDGE.api_keys, tenants=EDGE.tenants,
                      tenant_isolation=isolation)
    app = make_router_app(tokenizer, dispatcher, edge)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        for tenant in ("beta", "beta2", "lone", "acme"):
            reply = await http.post(COMPLETIONS, json=cmpl_body(), headers=bearer(tenant))
            assert reply.status_code == 200
    beta, beta2, lone, acme = (call.sampling.cache_salt for call in dispatcher.calls)
    if isolation == "off":
        assert (beta, beta2, lone, acme) == (None, None, None, None)
    else:
        assert beta == beta2 and len({beta, lone, acme}) == 3 and None not in (beta, lone)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_tenant_is_settled_before_the_responses_last_bytes(
        tokenizer: Any, stream: bool) -> None:
    """A client that sends its next request as soon as it has read the last byte finds
    its slot free and its completion charged: both happen before that byte is sent."""
    app = make_router_app(tokenizer, FakeDispatcher(output_ids=[5, 6, 7]), EDGE)
    limiter = app.state.tenants[KEYS["acme"].encode()].limiter
    series = ("pdserve:tenant_completion_tokens_total", {"tenant": "acme"})
    at_last_byte: list[tuple[int, float | None]] = []

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        async def send_watched(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                at_last_byte.append((limiter.num_running,
                                     app.state.registry.get_sample_value(*series)))
            await send(message)
        await app(scope, receive, send_watched)

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=watching),
                                 base_url="http://test") as http:
        reply = await http.post(COMPLETIONS, json=cmpl_body(stream=stream, max_tokens=3),
                                headers=bearer("acme"))
    assert reply.status_code == 200
    charged = app.state.registry.get_sample_value(*series)
    assert charged is not None and charged > 0
    assert at_last_byte == [(0, charged)]
