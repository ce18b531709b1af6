"""KV events from engine to router index: vLLM's events translated to pdserve
hashes, the worker's mirror and its fan-out, and the router's follower over real
gRPC against simulated workers (a gap in seq leads to a resync; a departed worker
leaves the index)."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest_asyncio
from pdserve_testing import wait_until_async
from prometheus_client import CollectorRegistry
from unit.sim_cluster import start_sim_worker

from pdserve.core.block_hash import chain_hashes, salt_root
from pdserve.core.types import KvChange
from pdserve.membership.static import static_infos
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.kv_feed import KvIndexFeeder
from pdserve.router.dispatch.workers.pool import Worker
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.sim.engine import SimConfig
from pdserve.worker.vllm.kv_events import VllmEventTranslator, remove_stale_sockets

BS = 4
TOKENS = list(range(100, 100 + 6 * BS))


# vLLM's event classes by name and fields (the translator dispatches on the class name).
@dataclass
class BlockStored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    extra_keys: list[tuple[Any, ...] | None] | None = None
    lora_name: str | None = None


@dataclass
class BlockRemoved:
    block_hashes: list[Any]


@dataclass
class AllBlocksCleared:
    pass


def test_translator_chains_from_token_ids_not_vllm_hashes() -> None:
    ours = chain_hashes(TOKENS, BS)
    t = VllmEventTranslator(BS)
    assert t.translate([BlockStored([b"a", b"b"], None, TOKENS[:2 * BS], BS)]) == (
        False, ours[:2], [])
    # A later request extends the chain from vLLM's parent hash.
    assert t.translate([BlockStored([7, 8], b"b", TOKENS[2 * BS:4 * BS], BS)]) == (
        False, ours[2:4], [])
    assert t.translate([BlockRemoved([b"b", 999])]) == (False, [], [ours[1]])
    # A parent vLLM no longer reports cannot be chained: dropped, counted.
    assert t.translate([BlockStored([9], b"b", TOKENS[:BS], BS)]) == (False, [], [])
    assert t.num_unchained == 1
    # Partial blocks are ignored; clearing resets what came before in the batch.
    assert t.translate([BlockStored([5], None, TOKENS[:2], 2)]) == (False, [], [])
    assert t.translate([BlockStored([1], None, TOKENS[:BS], BS), AllBlocksCleared(),
                        BlockStored([2], None, TOKENS[:BS], BS)]) == (True, ours[:1], [])
    assert t.translate([BlockRemoved([7])]) == (False, [], [])  # gone with the clear


def test_a_salted_prompts_blocks_are_named_under_its_salt() -> None:
    """vLLM publishes the ``cache_salt`` it hashed into a prompt's first block among that
    block's extra keys: the worker names the blocks as the router does for the salt."""
    t = VllmEventTranslator(BS)
    salted = chain_hashes(TOKENS, BS, salt_root("tenant-a"))
    assert salted[0] != chain_hashes(TOKENS, BS)[0]
    assert salted != chain_hashes(TOKENS, BS, salt_root("tenant-b"))
    assert t.translate([BlockStored([b"a", b"b"], None, TOKENS[:2 * BS], BS,
                                    [("tenant-a",), None])]) == (False, salted[:2], [])
    assert t.translate([BlockStored([b"c"], b"b", TOKENS[2 * BS:3 * BS], BS,
                                    [None])]) == (False, salted[2:3], [])
    # A LoRA name comes first in the keys; multimodal pairs are tuples, not salts.
    assert t.translate([BlockStored([b"d"], None, TOKENS[:BS], BS, [("l", ("mm", 0), "s")],
                                    lora_name="l")]) == (False, chain_hashes(
                                        TOKENS[:BS], BS, salt_root("s")), [])


def _applied(m: KvCacheMirror, cleared: bool, stored: list[int], removed: list[int]
             ) -> KvChange:
    change = m.apply(cleared, stored, removed)
    assert change is not None
    return change


def test_mirror_counts_shared_hashes_and_numbers_changes() -> None:
    m = KvCacheMirror(BS)
    assert _applied(m, False, [1, 2], []).seq == 1
    assert m.apply(False, [2], []) is None  # already in the set: no change to publish
    change = _applied(m, False, [3], [2])
    assert (change.seq, change.stored, change.removed) == (2, (3,), ())  # 2 still counted
    assert _applied(m, False, [], [2]).removed == (2,)
    assert m.snapshot() == (3, [1, 3])
    assert _applied(m, True, [], []).cleared and len(m) == 0


async def test_subscriber_overflow_drops_and_heartbeats_say_where_we_are() -> None:
    m = KvCacheMirror(BS)
    sub = m.subscribe(max_queue=2)
    for i in range(5):
        m.apply(False, [i], [])
    assert sub.num_dropped == 3
    assert [(await sub.next(1)).seq for _ in range(2)] == [1, 2]
    beat = await sub.next(0.01)
    assert beat.is_heartbeat and beat.seq == 5
    sub.close()
    m.apply(False, [9], [])  # not offered to a closed subscription: only heartbeats
    assert (await sub.next(0.01)).is_heartbeat


def in_sync(index: PrefixIndex, engine: Any) -> bool:
    return index.blocks_of(engine.config.worker_id) == set(engine.mirror.snapshot()[1])


@dataclass
class SimCluster:
    engines: dict[str, Any] = field(default_factory=dict)
    servers: list[Any] = field(default_factory=list)
    workers: list[Worker] = field(default_factory=list)

    async def add(self, worker_id: str) -> None:
        server, port, engine = await start_sim_worker(
            SimConfig("prefill", worker_id, block_size=BS, num_blocks=8, step_overhead_s=0,
                      prefill_s_per_token=0))
        self.engines[worker_id] = engine
        self.servers.append(server)
        (info,) = static_infos([f"127.0.0.1:{port}"], [])
        self.workers.append(Worker(info))

    async def close(self) -> None:
        for w in self.workers:
            await w.close()
        for s in self.servers:
            await s.stop(0)


@pytest_asyncio.fixture(loop_scope="function")
async def sims() -> Any:
    cluster = SimCluster()
    yield cluster
    await cluster.close()


async def test_gap_in_kv_events_leads_to_a_resync(sims: SimCluster) -> None:
    await sims.add("p0")
    engine = sims.engines["p0"]
    engine.mirror._max_queue = 2  # this subscriber's queue overflows after 2 batches
    index, registry = PrefixIndex(), CollectorRegistry()
    feeder = KvIndexFeeder(lambda: sims.workers, index, registry)
    await feeder.start()
    try:
        (follower,) = feeder.followers
        assert await wait_until_async(lambda: follower.num_resyncs == 1, 5)  # the connect resync
        await engine.prefill(TOKENS[:3 * BS])
        assert await wait_until_async(lambda: in_sync(index, engine), 5)
        # Overflow the worker's queue for this subscriber in one go: batches are lost.
        (sub,) = engine.mirror._subscribers
        for i in range(10):
            engine.mirror.apply(False, [10_000 + i], [])
        assert sub.num_dropped == 8
        assert await wait_until_async(lambda: follower.last_seq == 3, 5)  # applied what it got
        assert follower.num_resyncs == 1
        await engine.prefill(TOKENS[3 * BS:])  # one more batch, after the gap
        assert await wait_until_async(lambda: follower.num_resyncs == 2, 5)
        assert await wait_until_async(lambda: in_sync(index, engine), 5)
        assert follower.last_seq == engine.mirror.seq
        assert registry.get_sample_value("pdserve:kv_events_resyncs_total",
                                         {"reason": "gap"}) == 1
    finally:
        await feeder.close()


async def test_departed_worker_leaves_the_index(sims: SimCluster) -> None:
    await sims.add("p0")
    await sims.add("p1")
    for wid in ("p0", "p1"):
        await sims.engines[wid].prefill(TOKENS)
    index = PrefixIndex()
    feeder = KvIndexFeeder(lambda: sims.workers, index, CollectorRegistry(), interval_s=0.05)
    await feeder.start()
    try:
        hashes = chain_hashes(TOKENS, BS)
        assert await wait_until_async(lambda: index.match(hashes) == {"p0": 6, "p1": 6}, 5)
        sims.workers.pop(0)  # p0 leaves the pool
        assert await wait_until_async(lambda: index.match(hashes) == {"p1": 6}, 5)
        # p1's process dies: its stream breaks and its entries go.
        await sims.servers[1].stop(0)
        assert await wait_until_async(lambda: index.workers() in ([], ["p1"]) and
                               index.match(hashes) == {}, 5)
    finally:
        await feeder.close()


async def test_sim_engine_evicts_lru_and_reports_it(sims: SimCluster) -> None:
    await sims.add("p0")
    engine = sims.engines["p0"]
    a = TOKENS
    b = [t + 1000 for t in TOKENS]
    assert await engine.prefill(a) == 0
    assert await engine.prefill(a) == 6 * BS - 1  # whole prompt cached; last token recomputed
    await engine.prefill(b)  # 6 new blocks in a cache of 8: a's oldest 4 go
    assert engine.mirror.snapshot()[1] == chain_hashes(a, BS)[4:] + chain_hashes(b, BS)
    assert await engine.prefill(a) == 0  # a's first block is gone: no prefix hit


def test_the_socket_files_of_killed_engines_are_removed_and_live_ones_kept(
        tmp_path: Path) -> None:
    """A killed engine leaves its bound ipc files; nothing accepts on them any more."""
    def bound(name: str, listening: bool) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(str(tmp_path / name))
        if listening:
            sock.listen()
        return sock

    live = [bound("pdserve-kvev-decode-0-7.pub", True),
            bound("pdserve-kvev-decode-0-7.replay", True)]
    for name in ("pdserve-kvev-decode-0-5.pub", "pdserve-kvev-decode-0-5.replay",
                 "other-9.pub"):
        bound(name, False).close()  # the process died: its file stays
    try:
        remove_stale_sockets(tmp_path)
        assert sorted(p.name for p in tmp_path.iterdir()) == [
            "other-9.pub", "pdserve-kvev-decode-0-7.pub", "pdserve-kvev-decode-0-7.replay"]
    finally:
        for sock in live:
            sock.close()
