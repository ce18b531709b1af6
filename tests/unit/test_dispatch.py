"""The router's dispatcher (``router/dispatch.py``) against scripted gRPC workers
(``fake_worker.py``): the P/D flow, the aggregated fallback, failures, and the cleanup
contract (every way the chunk iterator ends aborts the request on each worker involved).
Placement policies are tested as pure functions at the end."""

from __future__ import annotations

import asyncio
import types
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest
import pytest_asyncio
from pdserve.router.dispatch import PDDispatcher
from pdserve.router.placement import (
    Choice,
    LeastLoadedPlacement,
    Placement,
    RoundRobinPlacement,
    create_placement,
)
from pdserve.router.types import (
    NoWorkerAvailableError,
    SamplingSpec,
    TokenChunk,
    WorkerFailedError,
)
from pdserve.router.workers import WorkerLoad, WorkerPool, WorkerState
from prometheus_client import CollectorRegistry
from unit.fake_worker import FakeWorker, FakeWorkerServicer, eventually, start_fake_worker

PROMPT = (11, 12, 13, 14)
FALLBACKS = "pdserve_dispatch_prefill_fallbacks_total"
WAIT_S = 2.0


@dataclass
class Cluster:
    prefill: FakeWorker
    decode: FakeWorker
    pool: WorkerPool
    dispatcher: PDDispatcher
    registry: CollectorRegistry
    baseline: set[asyncio.Task[object]]

    @property
    def p(self) -> FakeWorkerServicer:
        return self.prefill.servicer

    @property
    def d(self) -> FakeWorkerServicer:
        return self.decode.servicer

    def fallbacks(self) -> float | None:
        return self.registry.get_sample_value(FALLBACKS)

    def new_tasks(self) -> set[asyncio.Task[object]]:
        """Tasks started since the fixture's setup (an abort in flight, a gRPC call), but
        the grpc server's own, whose coroutines are Cython's, not Python's."""
        return {t for t in asyncio.all_tasks() - self.baseline - {asyncio.current_task()}
                if isinstance(t.get_coro(), types.CoroutineType)}

    def assert_no_abort(self) -> None:
        """Checked right after the iterator ended: an abort would be a task by now."""
        assert not self.new_tasks()
        assert self.p.aborts == [] and self.d.aborts == []


@pytest_asyncio.fixture(loop_scope="function")
async def cluster() -> AsyncIterator[Cluster]:
    """One fake prefill and one fake decode worker, both healthy in the pool."""
    prefill = await start_fake_worker("prefill")
    decode = await start_fake_worker("decode")
    pool = WorkerPool([prefill.endpoint], [decode.endpoint])
    registry = CollectorRegistry()
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), registry, request_timeout_s=10.0)
    await pool.refresh_all()
    assert all(w.state.healthy for w in pool.all)
    c = Cluster(prefill, decode, pool, dispatcher, registry, asyncio.all_tasks())
    try:
        yield c
        # Leak check: nothing running on a worker, no request counted as assigned, no task
        # (an abort, a gRPC call) left pending by the test.
        await eventually(lambda: not c.p.inflight and not c.d.inflight, WAIT_S, "workers idle")
        await eventually(lambda: all(w.state.num_assigned == 0 for w in pool.all), WAIT_S,
                         "num_assigned back to 0")
        await eventually(lambda: not c.new_tasks(), WAIT_S, "no task left pending")
    finally:
        await pool.close()
        await asyncio.gather(prefill.stop(), decode.stop())


def spec(max_tokens: int) -> SamplingSpec:
    return SamplingSpec(max_tokens=max_tokens, temperature=0.0)


async def collect(chunks: AsyncIterator[TokenChunk], timeout_s: float = WAIT_S) -> list[TokenChunk]:
    async def run() -> list[TokenChunk]:
        return [c async for c in chunks]

    return await asyncio.wait_for(run(), timeout_s)


async def take(chunks: AsyncIterator[TokenChunk], n: int) -> list[TokenChunk]:
    return [await asyncio.wait_for(anext(chunks), WAIT_S) for _ in range(n)]


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


# ---- the P/D flow ------------------------------------------------------------------------


async def test_prefill_then_decode_with_kv_handle(cluster: Cluster) -> None:
    cluster.p.script.num_cached_tokens = 2
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(5)))

    assert chunks[0] == TokenChunk((42,), None, 2)
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

    assert chunks == [TokenChunk((42,), "length", 0)]
    (p,) = cluster.p.generates
    assert p.max_tokens == 1
    assert cluster.p.leases == {}  # no KV handle was requested, so none is held
    assert cluster.d.generates == []
    cluster.assert_no_abort()


async def test_prefill_stop_ends_the_request(cluster: Cluster) -> None:
    cluster.p.script.prefill_stop = True
    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(8)))

    assert chunks == [TokenChunk((42,), "stop", 0)]
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
    assert not cluster.pool.prefill[0].state.healthy
    assert cluster.dispatcher.is_ready()


async def test_prefill_invalid_argument_fails_the_request(cluster: Cluster) -> None:
    cluster.p.script.fail_code = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(WorkerFailedError, match="prefill rejected"):
        await collect(cluster.dispatcher.generate("r1", PROMPT, spec(4)))
    assert cluster.d.generates == []
    assert cluster.fallbacks() == 0
    assert cluster.pool.prefill[0].state.healthy
    await eventually(lambda: cluster.p.aborts == ["r1"], WAIT_S, "Abort on prefill")


async def test_no_healthy_decode_raises_before_first_chunk(cluster: Cluster) -> None:
    await cluster.decode.stop()
    await cluster.pool.refresh_all()
    assert not cluster.pool.decode[0].state.healthy
    assert not cluster.dispatcher.is_ready()

    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))
    with pytest.raises(NoWorkerAvailableError):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    assert cluster.p.generates == []


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
    assert cluster.pool.decode[0].state.healthy  # INTERNAL is not unreachable


async def test_decode_unreachable_after_prefill_releases_the_lease(cluster: Cluster) -> None:
    await cluster.decode.stop()  # the pool still believes it healthy
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(4))

    assert (await take(chunks, 1))[0].token_ids == (42,)
    assert cluster.p.leases  # a handle was handed out...
    with pytest.raises(WorkerFailedError):
        await asyncio.wait_for(anext(chunks), WAIT_S)
    await eventually(lambda: cluster.p.leases == {}, WAIT_S, "prefill lease released")
    assert cluster.p.aborts == ["r1"]
    assert not cluster.pool.decode[0].state.healthy


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


# ---- compatibility ----------------------------------------------------------------------------


async def test_incompatible_pair_falls_back_to_decode_alone(cluster: Cluster) -> None:
    cluster.d.script.compatibility_hash = "compat-b"
    await cluster.pool.refresh_all()
    assert cluster.pool.decode[0].state.compatibility_hash == "compat-b"

    chunks = await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))

    assert tokens(chunks) == [100, 101, 102]
    assert cluster.p.generates == []  # RoundRobinPlacement never pairs them
    (d,) = cluster.d.generates
    assert (d.prompt_token_ids, d.kv_handle, d.max_tokens) == (PROMPT, None, 3)
    assert cluster.fallbacks() == 1
    assert cluster.pool.prefill[0].state.healthy  # not a failure of the prefill worker


# ---- placement policies (pure functions) ------------------------------------------------------


def ws(role: str, i: int, healthy: bool = True, compat: str = "a", assigned: int = 0,
       waiting: int = 0, kv: float = 0.0) -> WorkerState:
    return WorkerState(endpoint=f"{role}-{i}", role=role, healthy=healthy,
                       compatibility_hash=compat, num_assigned=assigned,
                       load=WorkerLoad(num_waiting_reqs=waiting, kv_cache_usage=kv))


def workers(role: str, n: int) -> list[WorkerState]:
    return [ws(role, i) for i in range(n)]


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_without_healthy_decode_is_none(
    policy: Placement,
) -> None:
    assert policy.choose(workers("prefill", 1), [ws("decode", 0, healthy=False)], 0) is None
    assert policy.choose(workers("prefill", 1), [], 0) is None


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_skips_unhealthy_workers(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, healthy=False), ws("prefill", 1, assigned=5)]
    decode = [ws("decode", 0, assigned=5), ws("decode", 1, healthy=False)]
    for cursor in range(4):
        assert policy.choose(prefill, decode, cursor) == Choice(1, 0)


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_without_healthy_prefill_is_decode_alone(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, healthy=False)]
    assert policy.choose(prefill, workers("decode", 1), 0) == Choice(None, 0)
    assert policy.choose([], workers("decode", 1), 0) == Choice(None, 0)


@pytest.mark.parametrize("policy", [RoundRobinPlacement(), LeastLoadedPlacement()])
def test_placement_pairs_only_compatible_workers(
    policy: Placement,
) -> None:
    prefill = [ws("prefill", 0, compat="b"), ws("prefill", 1, compat="a", assigned=9)]
    assert policy.choose(prefill, workers("decode", 1), 0) == Choice(1, 0)
    assert policy.choose(prefill[:1], workers("decode", 1), 0) == Choice(None, 0)


def test_round_robin_rotates_with_the_cursor() -> None:
    policy = RoundRobinPlacement()
    prefill, decode = workers("prefill", 2), workers("decode", 3)
    assert [policy.choose(prefill, decode, c) for c in range(6)] == [
        Choice(c % 2, c % 3) for c in range(6)]


def test_round_robin_rotates_over_healthy_workers_only() -> None:
    policy = RoundRobinPlacement()
    decode = [ws("decode", 0), ws("decode", 1, healthy=False), ws("decode", 2)]
    assert [policy.choose([], decode, c) for c in range(4)] == [
        Choice(None, i) for i in (0, 2, 0, 2)]


def test_least_loaded_picks_fewest_assigned_plus_waiting() -> None:
    policy = LeastLoadedPlacement()
    prefill = [ws("prefill", 0, assigned=1, waiting=1), ws("prefill", 1, waiting=1)]
    decode = [ws("decode", 0, assigned=2), ws("decode", 1, assigned=1),
              ws("decode", 2, waiting=3)]
    for cursor in range(3):
        assert policy.choose(prefill, decode, cursor) == Choice(1, 1)


def test_least_loaded_breaks_busy_ties_by_kv_usage() -> None:
    policy = LeastLoadedPlacement()
    decode = [ws("decode", 0, assigned=1, kv=0.9), ws("decode", 1, waiting=1, kv=0.2)]
    assert policy.choose([], decode, 0) == Choice(None, 1)


def test_least_loaded_breaks_ties_by_cursor() -> None:
    policy = LeastLoadedPlacement()
    prefill, decode = workers("prefill", 2), workers("decode", 3)
    assert [policy.choose(prefill, decode, c) for c in range(6)] == [
        Choice(c % 2, c % 3) for c in range(6)]
    # Among the tied, the first at or after the cursor (wrapping), not the lowest index.
    decode = [ws("decode", 0), ws("decode", 1, assigned=1), ws("decode", 2)]
    assert [policy.choose([], decode, c) for c in range(3)] == [
        Choice(None, i) for i in (0, 2, 2)]


def test_create_placement_by_name() -> None:
    assert isinstance(create_placement("round_robin"), RoundRobinPlacement)
    assert isinstance(create_placement("least_loaded"), LeastLoadedPlacement)
    assert create_placement("least_loaded").name == "least_loaded"


def test_create_placement_unknown_name_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="cache_awar.*least_loaded, round_robin"):
        create_placement("cache_awar")
