"""The dispatcher's cleanup contract against scripted gRPC workers: however the chunk
iterator ends (a decode failure, the consumer closing it, cancellation), the request
is aborted on each worker involved and prefill's KV lease is released."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from unit.dispatch_cluster import PROMPT, WAIT_S, Cluster, spec, take, tokens
from unit.fake_worker import eventually

from pdserve.router.dispatch.base import WorkerFailedError

# ---- decode failures and cleanup -------------------------------------------------------------


async def test_decode_fails_mid_stream_aborts_both(cluster: Cluster) -> None:
    cluster.d.script.fail_code = grpc.StatusCode.INTERNAL
    cluster.d.script.fail_after_tokens = 2
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(6))

    got = await take(chunks, 3)
    assert tokens(got) == [42, 100, 101]
    with pytest.raises(WorkerFailedError, match="decode worker failed"):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    await eventually(lambda: cluster.p.aborts == ["r1"] and cluster.d.aborts == ["r1"],
                     WAIT_S, "Abort on prefill and decode")
    assert cluster.p.leases == {}  # prefill released its KV lease
    assert cluster.pool.decode[0].snapshot().healthy  # INTERNAL is not unreachable


async def test_decode_unreachable_after_prefill_releases_the_lease(cluster: Cluster) -> None:
    await cluster.decode.stop()  # the pool still believes it healthy
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))

    assert (await take(chunks, 1))[0].token_ids == (42,)
    assert cluster.p.leases  # a handle was handed out...
    with pytest.raises(WorkerFailedError):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    await eventually(lambda: cluster.p.leases == {}, WAIT_S, "prefill lease released")
    assert cluster.p.aborts == ["r1"]
    assert not cluster.pool.decode[0].snapshot().healthy


async def test_consumer_close_cancels_decode_and_aborts_both(cluster: Cluster) -> None:
    cluster.d.script.token_delay_s = 0.05
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(200))

    got = await take(chunks, 3)
    assert tokens(got) == [42, 100, 101]
    await asyncio.wait_for(chunks.aclose(), WAIT_S)
    await eventually(lambda: cluster.d.cancelled == ["r1"], WAIT_S, "decode call cancelled")
    await eventually(lambda: cluster.p.aborts == ["r1"] and cluster.d.aborts == ["r1"],
                     WAIT_S, "Abort on prefill and decode")
    assert cluster.p.leases == {}
    assert len(cluster.d.generates) == 1


async def test_consumer_close_after_first_chunk_releases_prefill(cluster: Cluster) -> None:
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))

    assert (await take(chunks, 1))[0].token_ids == (42,)
    assert cluster.p.leases  # prefill holds the KV for a decode that will never come
    await asyncio.wait_for(chunks.aclose(), WAIT_S)
    await eventually(lambda: cluster.p.aborts == ["r1"], WAIT_S, "Abort on prefill")
    assert cluster.p.leases == {}
    assert cluster.d.generates == [] and cluster.d.aborts == []


async def test_cancel_while_in_prefill_aborts_prefill(cluster: Cluster) -> None:
    cluster.p.script.prefill_delay_s = 30.0
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))
    task = asyncio.create_task(anext(chunks))
    await eventually(lambda: "r1" in cluster.p.inflight, WAIT_S, "prefill started")

    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, WAIT_S)
    await eventually(lambda: cluster.p.aborts == ["r1"], WAIT_S, "Abort on prefill")
    await eventually(lambda: cluster.p.cancelled == ["r1"], WAIT_S, "prefill call cancelled")
    assert cluster.d.generates == [] and cluster.d.aborts == []
