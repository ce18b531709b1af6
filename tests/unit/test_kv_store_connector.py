"""The cluster KV store's two connector sides on a real ``redis-server`` (no vLLM):
blocks one worker publishes behind a request are found by another worker's scheduler
side in one lookup and loaded bit-exact into its cache; another salt or weight version
never finds them; a stopped store costs one deadline and then is skipped; a load stops
at a corrupt or missing block (vLLM recomputes from there) and a corrupt value is
deleted; and the fetch-or-compute decision computes when computing is faster."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import pytest
import torch
from unit.connector_fakes import FakeRequest

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.metadata import PdserveConnectorMetadata, StoreCopy, StoreFeedback
from pdserve.kv_transfer.remote.base import StoreError, StoreOptions, create_store
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.remote.decision import FetchDecision
from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.kv_transfer.remote.names import KVIdentity
from pdserve.kv_transfer.remote.plan import StorePlanner
from pdserve.kv_transfer.remote.worker import StoreWorker

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

BS, NUM_BLOCKS, HEADS, HEAD2 = 4, 16, 2, 8
IDENT = KVIdentity("fp-test", "default", "float32", "cpu:test", BS, (2, HEADS, HEAD2))



@dataclass
class FakeOutput:
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)
    finished_sending: set[str] = field(default_factory=set)
    kv_connector_worker_meta: StoreFeedback | None = None
    invalid_block_ids: set[int] = field(default_factory=set)


def fake_request(request_id: str, all_token_ids: list[int], cache_salt: str | None = None,
                 num_computed_tokens: int = 0) -> Request:
    """connector_fakes' FakeRequest, typed as the vLLM ``Request`` it stands in for."""
    return cast("Request", FakeRequest(request_id, all_token_ids, cache_salt,
                                       num_computed_tokens))


def _output(output: FakeOutput) -> KVConnectorOutput:
    """``output`` typed as the vLLM ``KVConnectorOutput`` it stands in for."""
    return cast("KVConnectorOutput", output)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory="64mb") as redis_server:
        yield redis_server


def _caches(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn((NUM_BLOCKS, HEADS, BS, HEAD2), generator=gen) for _ in range(2)]


class Side:
    """One worker: its scheduler side's planner and its worker side over its cache."""

    def __init__(self, url: str, seed: int, per_token_s: float = 1e-3,
                 codec: str = "none") -> None:
        options = StoreOptions(timeout_s=0.3)
        self.kv = _caches(seed)
        layout = KVLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(self.kv)},
                                         NUM_BLOCKS, BS)
        decision = FetchDecision(block_bytes=2 * HEADS * BS * HEAD2 * 4, block_size=BS,
                                 per_token_s=per_token_s)
        self.plan = StorePlanner(lambda: create_store(url, options), IDENT, BS, decision,
                                 ttl_s=60)
        self.worker = StoreWorker(lambda: create_store(url, options), self.kv, layout,
                                  codec_for(codec, layout), ttl_s=60)

    def publish(self, request: Request, block_ids: list[int]) -> None:
        meta = PdserveConnectorMetadata()
        assert self.plan.plan_save(request, block_ids, meta)
        copy = meta.store_saves[request.request_id]
        assert self.worker.save(request.request_id, copy) > 0
        assert self.worker.flush(5.0)
        self.report(FakeOutput(finished_sending={request.request_id}))

    def report(self, output: FakeOutput) -> None:
        """``output`` with what the worker side reports at the step's end."""
        loads, unpublished, published = self.worker.take_feedback()
        output.kv_connector_worker_meta = StoreFeedback(0, loads, unpublished, published)
        self.plan.update(_output(output))

    def load(self, request: Request, dst: list[int]) -> tuple[int, int]:
        """(blocks planned, blocks loaded); the blocks not loaded reported as vLLM's
        ``invalid_block_ids``, as the worker side does."""
        meta = PdserveConnectorMetadata()
        num = self.plan.plan_load(request.request_id, tuple(dst), meta)
        copy = meta.store_loads[request.request_id]
        _, loaded = self.worker.load(request.request_id, copy)
        self.report(FakeOutput({request.request_id},
                               invalid_block_ids=set(copy.block_ids[loaded:])))
        return num, loaded

    def close(self) -> None:
        self.worker.close()
        self.plan.close()


def _prompt(tag: int, num_tokens: int = 5 * BS + 1) -> list[int]:
    return [(tag * 1000 + i) % 50000 for i in range(num_tokens)]


@pytest.fixture
def sides(server: LocalRedis) -> Iterator[tuple[Side, Side]]:
    a, b = Side(server.url, 1), Side(server.url, 2)
    yield a, b
    a.close()
    b.close()


def test_blocks_published_by_one_worker_load_bit_exact_on_another(
        sides: tuple[Side, Side]) -> None:
    a, b = sides
    tokens = _prompt(1)
    a.publish(fake_request("a1", tokens, num_computed_tokens=len(tokens)), [3, 5, 7, 9, 11])
    changes = a.plan.take_changes()
    assert changes and changes[0][0] == "store" and len(changes[0][2]) == 5
    assert changes[0][1] is True
    # announced removed once their TTL (60 s) is over: the store expires them silently
    assert a.plan.take_changes(time.monotonic() + 30) == []
    (gone,) = a.plan.take_changes(time.monotonic() + 61)
    assert gone == ("store", False, changes[0][2])
    # b's engine holds nothing: the store has all five full blocks, the last token's
    # block is never loaded (it is computed)
    request = fake_request("b1", tokens)
    assert b.plan.match(request, 0) == 5 * BS
    assert b.load(request, [0, 1, 2, 4, 6]) == (5, 5)
    for src, dst in zip([3, 5, 7, 9, 11], [0, 1, 2, 4, 6], strict=True):
        for layer_a, layer_b in zip(a.kv, b.kv, strict=True):
            assert torch.equal(layer_a[src], layer_b[dst])
    counts = b.plan.take_counts()
    assert counts["store_lookups"] == 1 and counts["store_hit_blocks"] == 5
    assert counts["store_fetch_chosen"] == 1
    assert b.worker.stats()["store_load_blocks"] == 5


def test_a_later_start_looks_up_only_the_rest_and_a_hole_stops_the_run(
        sides: tuple[Side, Side], server: LocalRedis) -> None:
    a, b = sides
    tokens = _prompt(2)
    a.publish(fake_request("a2", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    request = fake_request("b2", tokens)
    assert b.plan.match(request, 2 * BS) == 3 * BS  # the engine holds the first two
    b.plan.unmatch("b2")
    names = b.plan.names(request, 5)
    server.client().delete(names[3].key)  # evicted from the middle
    assert b.plan.match(fake_request("b3", tokens), 0) == 3 * BS  # only up to the hole


def test_another_salt_or_weight_version_never_finds_the_blocks(
        sides: tuple[Side, Side]) -> None:
    a, b = sides
    tokens = _prompt(3)
    a.publish(fake_request("a3", tokens, cache_salt="tenant-a",
                           num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    assert b.plan.match(fake_request("x", tokens, cache_salt="tenant-a"), 0) == 5 * BS
    b.plan.unmatch("x")
    for salt in (None, "tenant-b", "tenant-a@weights:v2", "@weights:v2"):
        assert b.plan.match(fake_request(f"y{salt}", tokens, cache_salt=salt), 0) == 0
    # and the identity's fields split the versioned salt: tenant and version each named
    v2 = b.plan.names(fake_request("z", tokens, cache_salt="tenant-a@weights:v2"), 1)[0]
    assert (v2.identity.cache_salt, v2.identity.weight_version) == ("tenant-a", "v2")


def test_a_corrupt_block_stops_the_load_there_and_is_deleted_then_published_again(
        sides: tuple[Side, Side], server: LocalRedis) -> None:
    a, b = sides
    tokens = _prompt(4)
    a.publish(fake_request("a4", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    request = fake_request("b4", tokens)
    assert b.plan.match(request, 0) == 5 * BS
    key = b.plan.names(request, 5)[2].key
    client = server.client()
    raw = client.get(key)
    assert isinstance(raw, bytes)
    value = bytearray(raw)
    value[-1] ^= 0xFF  # a flipped byte in the payload
    client.set(key, bytes(value))
    before = [t.clone() for t in b.kv]
    stats = b.worker.stats()
    assert b.load(request, [5, 6, 7, 8, 9]) == (5, 2)  # the blocks before it load
    after = b.worker.stats()
    for name in ("store_bad_blocks", "store_bad_deleted", "store_load_failures",
                 "store_load_missing"):
        assert after[name] - stats[name] == 1, name
    assert after["store_load_blocks"] - stats["store_load_blocks"] == 2
    assert b.plan.take_counts()["store_load_failed"] == 1
    for layer_a, layer_b, old in zip(a.kv, b.kv, before, strict=True):
        assert torch.equal(layer_b[5:7], layer_a[0:2])  # loaded bit-exact
        assert torch.equal(layer_b[7:10], old[7:10])  # the rest: not written
    assert client.exists(key) == 0  # deleted: not there until its TTL
    # b computed the blocks; it publishes the one the store lost (SET NX succeeds now)
    written = b.worker.stats()["store_put_written"]
    b.publish(fake_request("b4", tokens, num_computed_tokens=len(tokens)), [5, 6, 7, 8, 9])
    assert b.worker.stats()["store_put_written"] - written == 1
    assert a.plan.match(fake_request("a5", tokens), 0) == 5 * BS  # whole again


def test_a_block_gone_between_lookup_and_load_loads_the_prefix_before_it(
        sides: tuple[Side, Side], server: LocalRedis) -> None:
    a, b = sides
    tokens = _prompt(15)
    a.publish(fake_request("a15", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    request = fake_request("b15", tokens)
    assert b.plan.match(request, 0) == 5 * BS
    server.client().delete(b.plan.names(request, 5)[3].key)  # expired after the lookup
    missing = b.worker.stats()["store_load_missing"]
    assert b.load(request, [0, 1, 2, 3, 4]) == (5, 3)
    assert b.worker.stats()["store_load_missing"] - missing == 1
    assert b.plan.take_counts()["store_load_failed"] == 1
    for layer_a, layer_b in zip(a.kv, b.kv, strict=True):
        assert torch.equal(layer_b[0:3], layer_a[0:3])
    # the request is not asked again (vLLM computes its rest); the lost block is
    # published again by whoever computes it next
    assert b.plan.match(request, 3 * BS) == 0


def test_a_stopped_store_costs_one_deadline_then_lookups_pause(server: LocalRedis) -> None:
    with LocalRedis(maxmemory="16mb") as paused:
        side = Side(paused.url, 3)
        try:
            side.plan.match(fake_request("warm", _prompt(5)), 0)  # connected
            paused.send_signal(signal.SIGSTOP)
            start = time.monotonic()
            assert side.plan.match(fake_request("p1", _prompt(6)), 0) == 0
            first = time.monotonic() - start
            start = time.monotonic()
            assert side.plan.match(fake_request("p2", _prompt(7)), 0) == 0
            second = time.monotonic() - start
            # a publish while down is not even planned
            assert not side.plan.plan_save(fake_request("p3", _prompt(8),
                                                        num_computed_tokens=21),
                                           [0, 1, 2, 3, 4], PdserveConnectorMetadata())
            paused.send_signal(signal.SIGCONT)
        finally:
            side.close()
        counts = side.plan.take_counts()
        assert counts["store_lookup_timeouts"] == 1 and counts["store_lookups_skipped"] == 1
        assert first < 2.0 and second < 0.05


def test_computing_wins_when_the_engine_is_faster_than_the_store(
        server: LocalRedis) -> None:
    a, fast = Side(server.url, 4), Side(server.url, 5, per_token_s=1e-9)
    try:
        tokens = _prompt(9)
        a.publish(fake_request("a9", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
        assert fast.plan.match(fake_request("f9", tokens), 0) == 0
        assert fast.plan.take_counts()["store_compute_chosen"] == 1
        # what the worker side reports moves the decision: a slow engine fetches again
        fast.plan.update(_output(FakeOutput(
            kv_connector_worker_meta=StoreFeedback(per_token_ns=10**6))))
        assert fast.plan.match(fake_request("f10", tokens), 0) == 5 * BS
    finally:
        a.close()
        fast.close()


def test_blocks_a_worker_knows_it_published_are_not_published_again(
        sides: tuple[Side, Side]) -> None:
    a, _ = sides
    tokens = _prompt(10)
    a.publish(fake_request("a10", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    longer = tokens + _prompt(11, 2 * BS)
    meta = PdserveConnectorMetadata()
    assert a.plan.plan_save(fake_request("a11", longer, num_computed_tokens=len(longer)),
                            list(range(7)), meta)
    assert len(meta.store_saves["a11"].names) == 2  # only the two new blocks
    a.worker.save("a11", meta.store_saves["a11"])
    assert a.worker.flush(5.0)
    a.report(FakeOutput(finished_sending={"a11"}))  # the writer published them
    again = PdserveConnectorMetadata()
    assert not a.plan.plan_save(fake_request("a12", longer, num_computed_tokens=len(longer)),
                                list(range(7)), again)
    # a publication that failed is forgotten: the next request publishes it again
    a.plan.update(_output(FakeOutput(kv_connector_worker_meta=StoreFeedback(
        unpublished=[n.key for n in meta.store_saves["a11"].names]))))
    assert a.plan.plan_save(fake_request("a13", longer, num_computed_tokens=len(longer)),
                            list(range(7)), again)
    assert len(again.store_saves["a13"].names) == 2


def test_a_block_the_store_lost_is_published_again(sides: tuple[Side, Side],
                                                   server: LocalRedis) -> None:
    a, _ = sides
    tokens = _prompt(12)
    a.publish(fake_request("a12", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    lost = a.plan.names(fake_request("q", tokens), 5)[2]
    server.client().delete(lost.key)  # evicted by the server's memory cap
    assert a.plan.match(fake_request("a13", tokens), 0) == 2 * BS  # up to the hole
    meta = PdserveConnectorMetadata()
    assert a.plan.plan_save(fake_request("a14", tokens, num_computed_tokens=len(tokens)),
                            [0, 1, 2, 3, 4], meta)
    assert [n.key for n in meta.store_saves["a14"].names] == [lost.key]


def test_a_store_down_at_start_is_a_miss_and_a_skipped_write(server: LocalRedis) -> None:
    def unreachable() -> Any:
        raise StoreError("KV store 127.0.0.1:1: no node answered")

    side = Side(server.url, 6)
    side.worker.close()
    layout = KVLayout.from_kv_caches({f"l{i}": t for i, t in enumerate(side.kv)},
                                     NUM_BLOCKS, BS)
    side.worker = StoreWorker(unreachable, side.kv, layout, codec_for("none", layout), 60)
    try:
        tokens = _prompt(13)
        names = tuple(side.plan.names(fake_request("d", tokens), 5))
        assert side.worker.load("d1", StoreCopy((0, 1, 2, 3, 4), names)) == (0, 0)
        assert side.worker.stats()["store_load_failures"] == 1
        assert side.worker.save("d2", StoreCopy((0, 1), names[:2])) > 0
        assert side.worker.flush(5.0)
        _, unpublished, published = side.worker.take_feedback()
        assert unpublished == [n.key for n in names[:2]] and published == []
        assert side.worker.stats()["store_put_failures"] == 1
    finally:
        side.close()


def test_a_save_larger_than_the_writers_queue_publishes_the_prefix_that_fits(
        sides: tuple[Side, Side], monkeypatch: pytest.MonkeyPatch) -> None:
    a, _ = sides
    block_bytes = 2 * HEADS * BS * HEAD2 * 4
    monkeypatch.setattr("pdserve.kv_transfer.remote.worker.QUEUE_BYTES", 3 * block_bytes + 100)
    tokens = _prompt(14)
    names = tuple(a.plan.names(fake_request("s", tokens), 5))
    assert a.worker.save("s1", StoreCopy((0, 1, 2, 3, 4), names)) > 0
    assert a.worker.flush(5.0)
    _, unpublished, published = a.worker.take_feedback()
    assert [k for k, _ in published] == [n.key for n in names[:3]]  # a prefix stays useful
    assert unpublished == [n.key for n in names[3:]]
    assert a.worker.stats()["store_save_dropped"] == 2



def test_a_worker_side_that_turned_the_store_off_stops_the_scheduler_side(
        sides: tuple[Side, Side]) -> None:
    from pdserve.kv_transfer.cache_io import CacheIO
    from pdserve.kv_transfer.config import ConnectorConfig
    from pdserve.kv_transfer.step_model import StepTimer

    a, b = sides
    tokens = _prompt(9)
    a.publish(fake_request("a9", tokens, num_computed_tokens=len(tokens)), [0, 1, 2, 3, 4])
    # b's worker side found its attention layers are not those the names say: no store
    io = CacheIO(ConnectorConfig(engine_id="w"), 0, None, lambda **_: None)  # type: ignore[arg-type]
    io.tell_store_off = True
    feedback = io.feedback(StepTimer())
    assert feedback is not None and feedback.store_off
    assert io.feedback(StepTimer()) is None  # said once
    b.plan.update(_output(FakeOutput(kv_connector_worker_meta=feedback)))
    assert b.plan.match(fake_request("b9", tokens), 0) == 0  # held, never looked up
    assert not b.plan.plan_save(fake_request("b10", _prompt(10), num_computed_tokens=5 * BS),
                                [5, 6, 7, 8, 9], PdserveConnectorMetadata())
    assert "store_lookups" not in b.plan.take_counts()
