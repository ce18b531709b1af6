"""Conditional disaggregation through the dispatcher and the HTTP app, on the scripted
fake workers (``fake_worker.py``): a short prompt in ``auto`` runs on decode alone, a
long one goes prefill → decode, and the decision shows in the response header, the
usage extension and ``pdserve:disagg_decisions_total``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from unit.dispatch_cluster import Cluster, collect, running_cluster, spec, tokens
from unit.fakes import ROUTER_MODEL, asgi_http_client, chat_body, cmpl_body, sse_payloads

from pdserve.router.dispatch.policies.disagg import DisaggConfig, DisaggDecision
from pdserve.router.http.app import create_app
from pdserve.router.http.openai.request_output import DISAGG_HEADER

AUTO = DisaggConfig(mode="auto", local_prefill_max_tokens=64)
SHORT = tuple(range(11, 21))
LONG = tuple(range(1000, 1100))


@pytest_asyncio.fixture(loop_scope="function")
async def auto_cluster() -> AsyncIterator[Cluster]:
    async with running_cluster(AUTO) as c:
        yield c


def app_for(cluster: Cluster, tokenizer: Any) -> Any:
    return create_app(served_model_name=ROUTER_MODEL, max_model_len=4096, tokenizer=tokenizer,
                      dispatcher=cluster.dispatcher, registry=cluster.registry)


async def test_short_prompt_runs_on_decode_alone(auto_cluster: Cluster) -> None:
    c = auto_cluster
    chunks = await collect(c.dispatcher.generate("r1", SHORT, spec(3)))

    assert tokens(chunks) == [100, 101, 102]
    assert chunks[0].disagg == DisaggDecision("local", "short_prompt")
    assert c.p.generates == []
    (d,) = c.d.generates
    assert (d.phase, d.prompt_token_ids, d.kv_handle, d.max_tokens) == (
        "decode", SHORT, None, 3)
    assert c.decisions("local", "short_prompt") == 1
    assert c.fallbacks() == 0  # a decision, not a failure
    c.assert_no_abort()


async def test_long_prompt_goes_prefill_then_decode(auto_cluster: Cluster) -> None:
    c = auto_cluster
    chunks = await collect(c.dispatcher.generate("r1", LONG, spec(3)))

    assert tokens(chunks) == [42, 100, 101]
    assert chunks[0].disagg == DisaggDecision("remote", "long_prompt")
    assert [g.phase for g in c.p.generates] == ["prefill"]
    (d,) = c.d.generates
    assert d.kv_handle is not None
    assert c.decisions("remote", "long_prompt") == 1 and c.decisions("local", "short_prompt") == 0


async def test_never_sends_long_prompts_to_decode_alone() -> None:
    async with running_cluster(DisaggConfig(mode="never")) as c:
        chunks = await collect(c.dispatcher.generate("r1", LONG, spec(2)))
        assert chunks[0].disagg == DisaggDecision("local", "never")
        assert c.p.generates == [] and len(c.d.generates) == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_decision_header_usage_and_metric_through_the_app(
    auto_cluster: Cluster, tokenizer: Any, stream: bool
) -> None:
    c = auto_cluster
    async with asgi_http_client(app_for(c, tokenizer)) as http:
        short = await http.post("/v1/completions", json=cmpl_body(
            prompt="hi", max_tokens=3, stream=stream,
            stream_options={"include_usage": True} if stream else None))
        long = await http.post("/v1/chat/completions", json=chat_body(
            messages=[{"role": "user", "content": "word " * 80}], max_tokens=3,
            stream=stream))
        metrics = (await http.get("/metrics")).text

    assert short.status_code == long.status_code == 200
    assert short.headers[DISAGG_HEADER] == "local; reason=short_prompt"
    assert long.headers[DISAGG_HEADER] == "remote; reason=long_prompt"
    assert len(c.p.generates) == 1 and len(c.d.generates) == 2
    if stream:
        usage = sse_payloads(short.text)[-2]["usage"]
    else:
        usage = short.json()["usage"]
        assert long.json()["usage"]["pdserve_disagg"] == "remote"
    assert usage["pdserve_disagg"] == "local"
    assert 'pdserve:disagg_decisions_total{decision="local",reason="short_prompt"} 1.0' in metrics
    assert 'pdserve:disagg_decisions_total{decision="remote",reason="long_prompt"} 1.0' in metrics


async def test_a_prefill_the_worker_aborted_falls_back_to_decode() -> None:
    """A prefill worker that ends a prefill ``abort`` itself (a role switch past its drain
    timeout) does not fail the request: decode computes the prompt, as after any failed
    prefill."""
    async with running_cluster() as c:
        c.p.script.fail_finish = "abort"
        chunks = await collect(c.dispatcher.generate("r-ab", (1, 2, 3, 4), spec(3)))
        assert tokens(chunks) == [100, 101, 102]
        (d,) = c.d.generates
        assert d.kv_handle is None and d.prompt_token_ids == (1, 2, 3, 4)
        assert c.fallbacks() == 1
