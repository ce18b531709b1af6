"""The router's dispatcher (``router/dispatch/dispatcher.py``) against scripted gRPC workers
(``fake_worker.py``): the P/D flow, the aggregated fallback and prefill failures.
Decode failures and the cleanup contract are in ``test_dispatch_cleanup.py``; the
placement policies in ``test_placement_policies.py``."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import grpc
import pytest
from unit.dispatch_cluster import (
    PROMPT,
    WAIT_S,
    Cluster,
    collect,
    running_cluster,
    spec,
    tokens,
)
from unit.fake_worker import eventually

from pdserve.router.dispatch.base import (
    NoWorkerAvailableError,
    RequestRejectedError,
    TokenChunk,
)
from pdserve.router.dispatch.policies.disagg import DisaggDecision

# ---- the P/D flow ------------------------------------------------------------------------


async def test_prefill_then_decode_with_kv_handle(cluster: Cluster) -> None:
    cluster.p.script.num_cached_tokens = 2
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(5)))

    assert chunks[0] == TokenChunk((42,), None, 2, DisaggDecision("remote", "always"))
    assert tokens(chunks) == [42, 100, 101, 102, 103]
    assert [c.finish_reason for c in chunks] == [None] * 4 + ["length"]
    (p,) = cluster.p.generates
    assert (p.phase, p.prompt_token_ids, p.max_tokens) == ("prefill", PROMPT, 5)
    (d,) = cluster.d.generates
    assert (d.phase, d.prompt_token_ids, d.max_tokens) == ("decode", PROMPT + (42,), 4)
    assert d.kv_handle is not None and d.kv_handle.transfer_id == "xfer-r1"
    assert d.kv_handle.engine_id.startswith("engine-")
    cluster.assert_no_abort()
    assert cluster.fallbacks() == 0


@pytest.mark.parametrize(("p_push", "d_push"), [(True, True), (True, False), (False, True)])
async def test_prefill_pushes_to_the_chosen_decode_only_when_both_can(
    cluster: Cluster, p_push: bool, d_push: bool
) -> None:
    cluster.p.script.kv_push = p_push
    cluster.d.script.kv_push, cluster.d.script.kv_port = d_push, 6123
    await cluster.pool.refresh_all()
    await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))
    (p,) = cluster.p.generates
    if p_push and d_push:
        assert p.kv_push_target is not None
        assert (p.kv_push_target.host, p.kv_push_target.port) == ("127.0.0.1", 6123)
        assert len(p.kv_push_target.transfer_id) == 32
    else:
        assert p.kv_push_target is None
    (d,) = cluster.d.generates
    assert d.kv_handle is not None  # decode always gets the prefill's handle


async def test_first_chunk_arrives_before_decode_produces(cluster: Cluster) -> None:
    """TTFT is the prefill time: t1 is yielded while decode has produced nothing yet."""
    gate = asyncio.Event()
    cluster.d.script.decode_gate = gate
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(3))
    first = await asyncio.wait_for(anext(chunks), WAIT_S)
    assert first.token_ids == (42,)
    gate.set()
    rest = await collect(chunks)
    assert tokens(rest) == [100, 101] and rest[-1].finish_reason == "length"


async def test_max_tokens_one_runs_prefill_only(cluster: Cluster) -> None:
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(1)))

    assert chunks == [TokenChunk((42,), "length", 0, DisaggDecision("remote", "always"))]
    (p,) = cluster.p.generates
    assert p.max_tokens == 1
    assert cluster.p.leases == {}  # no KV handle was requested, so none is held
    assert cluster.d.generates == []
    cluster.assert_no_abort()


async def test_prefill_stop_ends_the_request(cluster: Cluster) -> None:
    cluster.p.script.prefill_stop = True
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(8)))

    assert chunks == [TokenChunk((42,), "stop", 0, DisaggDecision("remote", "always"))]
    assert cluster.d.generates == []
    assert cluster.p.leases == {}
    cluster.assert_no_abort()


# ---- prefill failures ----------------------------------------------------------------------


@pytest.mark.parametrize("how", ["unavailable", "dead"])
async def test_prefill_unreachable_falls_back_to_decode(cluster: Cluster, how: str) -> None:
    if how == "dead":
        await cluster.prefill.stop()  # the pool still believes it healthy
    else:
        cluster.p.script.fail_code = grpc.StatusCode.UNAVAILABLE
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(4)))

    assert tokens(chunks) == [100, 101, 102, 103]
    assert chunks[-1].finish_reason == "length"
    (d,) = cluster.d.generates
    assert (d.prompt_token_ids, d.kv_handle, d.max_tokens) == (PROMPT, None, 4)
    assert cluster.fallbacks() == 1
    assert cluster.decisions("remote", "always") == 1  # the decision stands; it failed
    assert not cluster.pool.prefill[0].snapshot().healthy
    assert cluster.dispatcher.is_ready()


async def test_prefill_invalid_argument_fails_the_request(cluster: Cluster) -> None:
    """The request is at fault (HTTP 400), not the worker: no fallback, no ejection."""
    cluster.p.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(RequestRejectedError):
        await collect(cluster.dispatcher.generate("r1", PROMPT, spec(4)))
    assert cluster.d.generates == []
    assert cluster.fallbacks() == 0
    assert cluster.pool.prefill[0].snapshot().healthy
    await eventually(lambda: cluster.p.aborts == ["r1"], WAIT_S, "Abort on prefill")


async def test_no_healthy_decode_raises_before_first_chunk(cluster: Cluster) -> None:
    await cluster.decode.stop()
    await cluster.pool.refresh_all()
    assert not cluster.pool.decode[0].snapshot().healthy
    assert not cluster.dispatcher.is_ready()

    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))
    with pytest.raises(NoWorkerAvailableError):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    assert cluster.p.generates == []


# ---- compatibility ----------------------------------------------------------------------------


async def test_incompatible_pair_falls_back_to_decode_alone(cluster: Cluster) -> None:
    cluster.d.script.compatibility_hash = "compat-b"
    await cluster.pool.refresh_all()
    assert cluster.pool.decode[0].snapshot().compatibility_hash == "compat-b"

    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))

    assert tokens(chunks) == [100, 101, 102]
    assert cluster.p.generates == []  # RoundRobinPlacement never pairs them
    (d,) = cluster.d.generates
    assert (d.prompt_token_ids, d.kv_handle, d.max_tokens) == (PROMPT, None, 3)
    assert cluster.fallbacks() == 0  # a decision, not a failure: counted as one
    assert cluster.decisions("local", "no_prefill") == 1
    assert chunks[0].disagg == DisaggDecision("local", "no_prefill")
    assert cluster.pool.prefill[0].snapshot().healthy  # not a failure of the prefill worker


async def test_decode_continues_the_request_prefill_started(cluster: Cluster) -> None:
    """Decode's prompt ends with prefill's token: it is marked as output (penalties,
    min_tokens, the grammar), and the prompt's logprobs come from prefill alone."""
    sampling = replace(spec(4), prompt_logprobs=1, logprobs=0)
    await collect(cluster.dispatcher.generate("r-cont", PROMPT, sampling))
    prefill, decode = cluster.p.generates[0], cluster.d.generates[0]
    assert (prefill.prompt_logprobs, prefill.num_output_in_prompt) == (1, 0)
    assert (decode.prompt_logprobs, decode.num_output_in_prompt) == (None, 1)
    assert decode.prompt_token_ids[:-1] == PROMPT


async def test_a_sibling_follows_the_decode_worker_it_names() -> None:
    async with running_cluster(num_decode=2) as c:
        target = c.decodes[1].servicer
        chunks = await collect(c.dispatcher.generate(
            "r-sib", PROMPT, spec(3), affinity=target.worker_id))
        assert [g.phase for g in target.generates] == ["decode"]
        assert c.p.generates == [] and c.decodes[0].servicer.generates == []
        assert chunks[0].disagg is not None and chunks[0].disagg.reason == "sibling"
        assert {ch.decode_worker_id for ch in chunks} == {target.worker_id}
        # An unknown or unhealthy worker: placement decides as usual.
        await collect(c.dispatcher.generate("r-any", PROMPT, spec(3), affinity="gone"))
        assert c.p.generates[0].request_id == "r-any"

