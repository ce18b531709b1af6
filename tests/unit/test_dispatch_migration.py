"""Decode failover mid-stream (``router/migration.py``) against scripted gRPC workers
whose tokens are a function of the whole context (``tokens_from_context``): a decode
worker that fails after k tokens is replaced by another computing prompt + the tokens
sent, and the client's tokens equal the uninterrupted answer, none repeated or dropped.
The cluster fixture's leak check (workers idle, nothing assigned, no task pending)
runs after each test."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
import pytest_asyncio
from unit.dispatch_cluster import (
    PROMPT,
    WAIT_S,
    Cluster,
    collect,
    running_cluster,
    spec,
    take,
    tokens,
)
from unit.fake_worker import FakeWorkerServicer, eventually, greedy_answer
from unit.fakes import ROUTER_MODEL, asgi_http_client, cmpl_body, sse_payloads

from pdserve.core.types import PhaseTiming
from pdserve.router.dispatch.base import RequestRejectedError, WorkerFailedError
from pdserve.router.dispatch.migration import MigrationConfig
from pdserve.router.dispatch.timeline import RequestTimeline
from pdserve.router.http.app import create_app

MIGRATIONS = "pdserve:migrations_total"
REFUSED = "pdserve:migrations_failed_total"
MAX_TOKENS = 12


@pytest_asyncio.fixture(loop_scope="function")
async def pd2() -> AsyncIterator[Cluster]:
    """One prefill, two decode workers, every token from context; a request goes to the
    first of ``servicers`` (round robin starts there)."""
    async with running_cluster(num_decode=2) as c:
        context_tokens(c)
        yield c


def context_tokens(c: Cluster) -> None:
    for w in (c.prefill, *c.decodes):
        w.servicer.script.tokens_from_context = True


def servicers(c: Cluster) -> list[FakeWorkerServicer]:
    """The decode workers in the pool's order (round robin's first pick first)."""
    by_endpoint = {d.endpoint: d.servicer for d in c.decodes}
    return [by_endpoint[w.snapshot().endpoint] for w in c.pool.decode]


def migrations(c: Cluster, reason: str | None = None) -> float:
    """Migrations with ``reason``, or with any reason."""
    if reason is not None:
        return c.registry.get_sample_value(MIGRATIONS, {"reason": reason}) or 0.0
    return sum(s.value for m in c.registry.collect() if m.name == "pdserve:migrations"
               for s in m.samples if s.name == MIGRATIONS)


def refused(c: Cluster, reason: str) -> float:
    return c.registry.get_sample_value(REFUSED, {"reason": reason}) or 0.0


# ---- migration keeps the answer --------------------------------------------------------------


@pytest.mark.parametrize(("how", "reason"), [
    ("UNAVAILABLE", "unavailable"), ("INTERNAL", "internal"), ("error", "finish_error"),
    ("abort", "finish_abort")])
async def test_decode_failing_after_k_tokens_continues_on_another(
    pd2: Cluster, how: str, reason: str
) -> None:
    d1, d2 = servicers(pd2)
    if how.isupper():
        d1.script.fail_code = grpc.StatusCode[how]
    else:
        d1.script.fail_finish = how  # type: ignore[assignment]
    d1.script.fail_after_tokens = 4

    chunks = await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))

    want = greedy_answer(PROMPT, MAX_TOKENS)
    assert tokens(chunks) == want
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    (moved,) = d2.generates
    # Prompt + prefill's token + d1's 4, computed on d2 (no KV handle), the rest to go.
    assert moved.prompt_token_ids == PROMPT + tuple(want[:5])
    assert moved.kv_handle is None and moved.max_tokens == MAX_TOKENS - 5
    assert migrations(pd2, reason) == 1 and migrations(pd2) == 1
    await eventually(lambda: d1.aborts == ["r1"] and pd2.p.aborts == ["r1"], WAIT_S,
                     "abort on the failed decode and on prefill")
    assert pd2.p.leases == {}  # prefill's KV is not loaded by anyone now: released
    assert d2.aborts == []


async def test_decode_worker_killed_mid_stream(pd2: Cluster) -> None:
    """The worker's gRPC server stops while it streams (a dead process, as the router
    sees it): what reached the client and what d2 produces join without a seam."""
    d1, d2 = servicers(pd2)
    # After take(4) d1 still has 8 tokens to send: 1.6 s for the stop to land mid-stream,
    # while each token still comes well within take's per-chunk wait (WAIT_S).
    d1.script.token_delay_s = 0.2
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))
    got = await take(chunks, 4)
    (first,) = [d for d in pd2.decodes if d.servicer is d1]
    await first.stop()
    got += await collect(chunks)

    assert tokens(got) == greedy_answer(PROMPT, MAX_TOKENS)
    assert migrations(pd2, "unavailable") == 1
    assert len(d2.generates) == 1 and d2.generates[0].kv_handle is None
    (w1, _) = pd2.pool.decode
    assert not w1.snapshot().healthy  # out of placement until a health check passes


async def test_local_route_migrates_too(pd2: Cluster) -> None:
    """Decode alone (no prefill): the continuation is the prompt + the decode's tokens."""
    _, d2 = servicers(pd2)
    pd2.p.script.fail_code = grpc.StatusCode.UNAVAILABLE  # prefill fails: decode alone
    servicers(pd2)[0].script.fail_code = grpc.StatusCode.UNAVAILABLE
    servicers(pd2)[0].script.fail_after_tokens = 3

    chunks = await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))

    want = greedy_answer(PROMPT, MAX_TOKENS)
    assert tokens(chunks) == want
    assert d2.generates[0].prompt_token_ids == PROMPT + tuple(want[:3])
    assert d2.generates[0].max_tokens == MAX_TOKENS - 3


async def test_failure_before_any_decode_token_keeps_prefill_kv(pd2: Cluster) -> None:
    """Decode failed before streaming anything: the next decode loads prefill's KV (the
    handle goes along), so prefill is not aborted and keeps the lease for it."""
    d1, d2 = servicers(pd2)
    d1.script.fail_code = grpc.StatusCode.UNAVAILABLE

    chunks = await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))

    want = greedy_answer(PROMPT, MAX_TOKENS)
    assert tokens(chunks) == want
    (moved,) = d2.generates
    assert moved.kv_handle is not None and moved.kv_handle.transfer_id == "xfer-r1"
    assert moved.prompt_token_ids == PROMPT + (want[0],)
    assert moved.max_tokens == MAX_TOKENS - 1
    assert migrations(pd2, "unavailable") == 1
    await eventually(lambda: d1.aborts == ["r1"], WAIT_S, "abort on the failed decode")
    assert pd2.p.aborts == [] and "r1" in pd2.p.leases


async def test_failure_after_the_finish_is_not_a_migration(pd2: Cluster) -> None:
    d1, d2 = servicers(pd2)
    d1.script.fail_code = grpc.StatusCode.UNAVAILABLE
    d1.script.fail_after_tokens = MAX_TOKENS - 1  # every decode token, then the call fails

    chunks = await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))

    assert tokens(chunks) == greedy_answer(PROMPT, MAX_TOKENS)
    assert [c.finish_reason for c in chunks if c.finish_reason] == ["length"]
    assert d2.generates == [] and migrations(pd2) == 0


async def test_the_timeline_counts_the_migration_and_drops_the_handoff(
        pd2: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    """The last decode's timing does not measure the handoff from prefill: left out."""
    d1, d2 = servicers(pd2)
    pd2.p.script.timing = PhaseTiming(10**18, 10**18 + 5, 2, 3, 0)
    d2.script.timing = PhaseTiming(10**18 + 12, 10**18 + 20, 4, 1, 0)
    d1.script.fail_code, d1.script.fail_after_tokens = grpc.StatusCode.UNAVAILABLE, 2
    with caplog.at_level(logging.DEBUG, logger="pdserve.timeline"):
        await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS),
                                              RequestTimeline("r1")))
    (record,) = [r for r in caplog.records if r.name == "pdserve.timeline"]
    line = json.loads(record.getMessage())
    assert line["num_migrations"] == 1 and line["num_decode_steps"] == MAX_TOKENS - 2
    assert "handoff" not in line["phases_ms"] and "decode_queue" in line["phases_ms"]


@pytest.mark.parametrize("model", ["fake", "another-model"])
async def test_a_recomputing_continuation_may_change_dtype_never_model(
    pd2: Cluster, model: str
) -> None:
    """The only other decode worker has another compatibility hash (a bf16 worker beside
    float32 ones): a continuation that computes everything goes there if it serves the
    same model, never if it serves another."""
    d1, d2 = servicers(pd2)
    d2.script.compatibility_hash, d2.script.model = "compat-b", model
    await pd2.pool.refresh_all()
    d1.script.fail_code = grpc.StatusCode.UNAVAILABLE
    d1.script.fail_after_tokens = 4
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))
    if model == "fake":
        assert tokens(await collect(chunks)) == greedy_answer(PROMPT, MAX_TOKENS)
        (moved,) = d2.generates
        assert moved.kv_handle is None and migrations(pd2, "unavailable") == 1
    else:
        assert tokens(await take(chunks, 5)) == greedy_answer(PROMPT, 5)
        with pytest.raises(WorkerFailedError, match="no other compatible healthy decode"):
            await asyncio.wait_for(anext(chunks), WAIT_S)
        assert d2.generates == [] and refused(pd2, "no_worker") == 1
    await eventually(lambda: d1.aborts == ["r1"] and pd2.p.aborts == ["r1"], WAIT_S,
                     "abort on the failed decode and on prefill")


async def test_a_continuation_that_loads_kv_needs_the_same_hash(pd2: Cluster) -> None:
    """Failed before its first token, the request still loads prefill's KV: a worker of
    another hash cannot, however it is named."""
    d1, d2 = servicers(pd2)
    d2.script.compatibility_hash = "compat-b"
    await pd2.pool.refresh_all()
    d1.script.fail_code = grpc.StatusCode.UNAVAILABLE
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))
    assert tokens(await take(chunks, 1)) == greedy_answer(PROMPT, 1)  # prefill's
    with pytest.raises(WorkerFailedError, match="no other compatible healthy decode"):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    assert d2.generates == [] and refused(pd2, "no_worker") == 1
    await eventually(lambda: d1.aborts == ["r1"] and pd2.p.aborts == ["r1"], WAIT_S,
                     "abort on the failed decode and on prefill")


async def test_a_continuation_names_the_weights_version(pd2: Cluster) -> None:
    d1, d2 = servicers(pd2)
    pd2.dispatcher.weights.version = "default"
    d1.script.fail_code, d1.script.fail_after_tokens = grpc.StatusCode.UNAVAILABLE, 3
    chunks = await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))
    assert tokens(chunks) == greedy_answer(PROMPT, MAX_TOKENS)
    (moved,) = d2.generates
    assert moved.weight_version == "default"


async def test_a_continuation_goes_only_to_a_worker_on_its_version(pd2: Cluster) -> None:
    """A request admitted under version v goes on only on a worker serving v: with the
    other decode worker on another version, it fails over as with none left."""
    d1, d2 = servicers(pd2)
    pd2.dispatcher.weights.version = "default"
    d2.script.weight_version = "v-other"
    await pd2.pool.refresh_all()
    d1.script.fail_code, d1.script.fail_after_tokens = grpc.StatusCode.UNAVAILABLE, 3
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))
    assert tokens(await take(chunks, 4)) == greedy_answer(PROMPT, 4)
    with pytest.raises(WorkerFailedError, match="no other compatible healthy decode"):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    assert d2.generates == [] and refused(pd2, "no_worker") == 1
    await eventually(lambda: d1.aborts == ["r1"] and pd2.p.aborts == ["r1"], WAIT_S,
                     "abort on the failed decode and on prefill")


# ---- when it must not, or cannot, migrate ---------------------------------------------------


async def test_every_decode_failing_ends_in_an_error(pd2: Cluster) -> None:
    for d in servicers(pd2):
        d.script.fail_code = grpc.StatusCode.UNAVAILABLE
        d.script.fail_after_tokens = 2
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))

    got = await take(chunks, 5)  # prefill's token, 2 from d1, 2 from d2
    assert tokens(got) == greedy_answer(PROMPT, 5)
    with pytest.raises(WorkerFailedError, match="no other compatible healthy decode"):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    assert migrations(pd2) == 1 and refused(pd2, "no_worker") == 1
    await eventually(lambda: all(d.aborts == ["r1"] for d in servicers(pd2))
                     and pd2.p.aborts == ["r1"], WAIT_S, "abort on every worker")


@pytest.mark.parametrize("max_migrations", [0, 1])
async def test_max_migrations_bounds_the_moves(max_migrations: int) -> None:
    async with running_cluster(num_decode=3, migration=MigrationConfig(max_migrations)) as c:
        context_tokens(c)
        for d in servicers(c):
            d.script.fail_code = grpc.StatusCode.INTERNAL
            d.script.fail_after_tokens = 1
        chunks = c.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS))

        got = await take(chunks, 2 + max_migrations)
        with pytest.raises(WorkerFailedError, match=r"max migrations \(\d\) reached"):
            await asyncio.wait_for(anext(chunks), WAIT_S)
        assert tokens(got) == greedy_answer(PROMPT, 2 + max_migrations)
        assert [len(d.generates) for d in servicers(c)] == [1] * (1 + max_migrations) + [0] * (
            2 - max_migrations)
        assert migrations(c) == max_migrations and refused(c, "max_migrations") == 1


async def test_invalid_argument_does_not_migrate(pd2: Cluster) -> None:
    d1, d2 = servicers(pd2)
    d1.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    d1.script.fail_after_tokens = 2

    with pytest.raises(RequestRejectedError):  # the request's fault: HTTP 400
        await collect(pd2.dispatcher.generate("r1", PROMPT, spec(MAX_TOKENS)))
    assert d2.generates == [] and migrations(pd2) == 0
    await eventually(lambda: d1.aborts == ["r1"], WAIT_S, "abort on the decode")


@pytest.mark.parametrize("how", ["close", "cancel"])
async def test_client_going_away_does_not_migrate(pd2: Cluster, how: str) -> None:
    d1, d2 = servicers(pd2)
    # Tokens 0.5 s apart (within take's per-chunk wait, WAIT_S): the cancellation below
    # lands while the next one is awaited, not after it arrived.
    d1.script.token_delay_s = 0.5
    chunks = pd2.dispatcher.generate("r1", PROMPT, spec(200))
    await take(chunks, 3)

    if how == "close":
        await asyncio.wait_for(chunks.aclose(), WAIT_S)
    else:
        task = asyncio.ensure_future(anext(chunks))
        await asyncio.sleep(0)  # the task starts waiting for the next token
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)
        await asyncio.wait_for(chunks.aclose(), WAIT_S)
    await eventually(lambda: d1.aborts == ["r1"] and pd2.p.aborts == ["r1"], WAIT_S,
                     "abort on prefill and decode")
    assert d2.generates == [] and migrations(pd2) == 0


# ---- through the HTTP app --------------------------------------------------------------------


def app_for(c: Cluster, tokenizer: Any) -> Any:
    return create_app(served_model_name=ROUTER_MODEL, max_model_len=4096, tokenizer=tokenizer,
                      dispatcher=c.dispatcher, registry=c.registry)


@pytest.mark.parametrize("stream", [False, True])
async def test_migrated_request_answers_once_with_sane_usage(
    pd2: Cluster, tokenizer: Any, stream: bool
) -> None:
    d1, _ = servicers(pd2)
    d1.script.fail_code = grpc.StatusCode.UNAVAILABLE
    d1.script.fail_after_tokens = 3
    body = cmpl_body(prompt="hi", max_tokens=MAX_TOKENS, stream=stream, return_token_ids=True,
                     stream_options={"include_usage": True} if stream else None)
    async with asgi_http_client(app_for(pd2, tokenizer)) as http:
        resp = await asyncio.wait_for(http.post("/v1/completions", json=body), 10)

    assert resp.status_code == 200
    prompt = tuple(tokenizer.encode("hi"))
    if stream:
        events = sse_payloads(resp.text)
        ids = [t for e in events[:-2] for c in e["choices"] for t in c.get("token_ids") or []]
        usage = events[-2]["usage"]
    else:
        ids, usage = resp.json()["choices"][0]["token_ids"], resp.json()["usage"]
    assert ids == greedy_answer(prompt, MAX_TOKENS)
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == len(prompt)
    assert migrations(pd2) == 1


async def test_no_decode_left_is_an_sse_error_then_done(pd2: Cluster, tokenizer: Any) -> None:
    for d in servicers(pd2):
        d.script.fail_code = grpc.StatusCode.UNAVAILABLE
        d.script.fail_after_tokens = 2
    body = cmpl_body(prompt="hi", max_tokens=MAX_TOKENS, stream=True)
    async with asgi_http_client(app_for(pd2, tokenizer)) as http:
        resp = await asyncio.wait_for(http.post("/v1/completions", json=body), 10)

    assert resp.status_code == 200
    events = sse_payloads(resp.text)
    assert events[-1] == "[DONE]"
    assert "error" in events[-2] and "decode worker failed" in events[-2]["error"]["message"]
