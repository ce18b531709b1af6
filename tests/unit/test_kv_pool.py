"""The cluster KV pool without vLLM: a worker pulls blocks by hash from a peer's host
tier over each transport (the bytes land in the right blocks); a block the peer no
longer holds, a slot rewritten while it was sent, or a peer that is gone fails the
pull (the connector then recomputes); the scheduler side plans a pool load after
the local tiers' blocks and names the tiers' residency for the router."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, make_caches, start_transport, wait_until
from unit.test_kv_tiers import BS, CONFIG, _alloc, _done, _h, _host, _request, _step

from pdserve.core.block_hash import chain_hashes, salt_root, tier_hashes
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.scheduler_side import SchedulerSide
from pdserve.kv_transfer.tiers.store import TierStore

TRANSPORTS = ["tcp", "ucx", "torch"]


def _block(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[block].clone() for t in caches.values()]


class _Pair:
    """A serving worker (host tier over its cache) and a pulling one, in-process."""

    def __init__(self, name: str) -> None:
        self.src = make_caches(1, torch.float32)
        self.dst = make_caches(2, torch.float32)
        layout = KVLayout.from_kv_caches(self.src, NUM_BLOCKS, 16)
        self.store = TierStore(list(self.src.values()), layout, 8, True, None, "")
        self.server, self.port = start_transport(name, self.src, LeaseTable())
        self.server.serve_pool(self.store.serve)
        self.client, _ = start_transport(name, self.dst, LeaseTable())
        self.peer = PeerAddress("127.0.0.1", self.port)

    def save(self, blocks: list[int], slots: list[int], hashes: list[bytes]) -> None:
        assert self.store.host is not None
        self.store.host.save(blocks, slots, hashes)

    def close(self) -> None:
        self.client.close()
        self.server.close()


@pytest.fixture(params=TRANSPORTS)
def pair(request: pytest.FixtureRequest) -> Any:
    p = _Pair(request.param)
    yield p
    p.close()


def test_a_peer_pulls_blocks_by_hash_from_the_host_tier(pair: _Pair) -> None:
    pair.save([3, 4, 5], [0, 1, 2], [_h(3), _h(4), _h(5)])
    want = [_block(pair.src, b) for b in (4, 5)]
    nbytes = pair.client.pull_pool(pair.peer, [_h(4), _h(5)], [10, 2],
                                   time.monotonic() + 10)
    assert nbytes == 2 * pair.store.host.block_bytes  # type: ignore[union-attr]
    for got_block, expected in zip((10, 2), want, strict=True):
        for got, exp in zip(_block(pair.dst, got_block), expected, strict=True):
            assert torch.equal(got, exp)
    assert wait_until(lambda: pair.store.stats()["pool_serve_blocks"] == 2, timeout_s=5)
    assert pair.store.stats()["pool_serves"] == 1


def test_a_block_the_peer_does_not_hold_fails_the_pull_and_writes_nothing(pair: _Pair) -> None:
    pair.save([3], [0], [_h(3)])
    before = _block(pair.dst, 7)
    with pytest.raises(TransferError, match="not in the host tier"):
        pair.client.pull_pool(pair.peer, [_h(3), _h(9)], [6, 7], time.monotonic() + 10)
    assert all(torch.equal(a, b) for a, b in zip(_block(pair.dst, 7), before, strict=True))
    assert wait_until(lambda: pair.store.stats()["pool_serve_failures"] == 1, timeout_s=5)
    # The connection is still good: the next pull works.
    pair.client.pull_pool(pair.peer, [_h(3)], [6], time.monotonic() + 10)


def test_a_slot_rewritten_while_it_is_sent_fails_the_pull(pair: _Pair) -> None:
    pair.save([3], [0], [_h(3)])
    real = pair.store.serve

    def rewritten(hashes: list[bytes]) -> Any:
        serve = real(hashes)
        pair.save([5], [0], [_h(5)])  # the slot gets another block before the trailer
        return serve

    pair.server.serve_pool(rewritten)
    with pytest.raises(TransferError, match="rewritten"):
        pair.client.pull_pool(pair.peer, [_h(3)], [6], time.monotonic() + 10)
    assert wait_until(lambda: pair.store.stats()["pool_serve_failures"] == 1, timeout_s=5)


def test_a_worker_without_a_pool_refuses_and_a_gone_peer_fails_in_time() -> None:
    caches = make_caches(1, torch.float32)
    server, port = start_transport("tcp", caches, LeaseTable())
    client, _ = start_transport("tcp", make_caches(2, torch.float32), LeaseTable())
    try:
        with pytest.raises(TransferError, match="serves no KV pool"):
            client.pull_pool(PeerAddress("127.0.0.1", port), [_h(1)], [1],
                             time.monotonic() + 10)
        server.close()
        start = time.monotonic()
        with pytest.raises(TransferError):
            client.pull_pool(PeerAddress("127.0.0.1", port), [_h(1)], [1], start + 5)
        # Ended by the refusal or the 5 s deadline (10 s of slack for a loaded machine),
        # not a hang.
        assert time.monotonic() - start < 15
    finally:
        client.close()
        server.close()


# ---- the scheduler side ----------------------------------------------------------------

POOL = {"host": "10.0.0.2", "port": 7000, "num_blocks": 3, "worker_id": "p1"}


def _pool_request(req_id: str, num_tokens: int) -> Any:
    req = _request(req_id, num_tokens, computed=0)
    req.kv_transfer_params = {"do_remote_decode": True, "pool": dict(POOL)}
    return req


def test_the_pool_loads_what_the_local_tiers_lack_up_to_the_peers_blocks() -> None:
    side = SchedulerSide(CONFIG, BS, _host(8))
    first = _request("a", 2 * BS)  # block 0 ends up in the local host tier
    side.request_finished(first, [7, 8])
    _done(side, sending={"a"})
    # 5 full blocks before the last token; local tier has 2, the peer 3: pool gets block 2.
    req = _pool_request("b", 5 * BS + 1)
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    side.update_state_after_alloc(req, _alloc([20, 21, 22]), 3 * BS)
    meta = _step(side)
    assert meta.tier_loads["b"].block_ids == (20, 21)
    load = meta.pool_loads["b"]
    assert (load.host, load.port, load.block_ids, load.hashes) == (
        "10.0.0.2", 7000, (22,), (req.block_hashes[2],))
    assert side.tier_tokens("b") == {"host": 2 * BS, "pool": BS}
    _done(side, recving={"b"})
    assert side.tier_tokens("b") == {}


def test_the_pool_never_loads_the_last_token_and_ignores_a_bad_source() -> None:
    side = SchedulerSide(CONFIG, BS, None)
    req = _pool_request("c", 2 * BS)  # the last token's block is computed
    assert side.get_num_new_matched_tokens(req, 0) == (BS, True)
    bad = _pool_request("d", 4 * BS)
    bad.kv_transfer_params["pool"] = {"host": "x"}
    assert side.get_num_new_matched_tokens(bad, 0) == (0, False)
    off = SchedulerSide(CONFIG, BS, None, pool=False)
    assert off.get_num_new_matched_tokens(_pool_request("e", 4 * BS), 0) == (0, False)


def test_a_pool_match_vllm_did_not_allocate_is_dropped_at_finish() -> None:
    side = SchedulerSide(CONFIG, BS, None)
    req = _pool_request("f", 4 * BS)
    side.get_num_new_matched_tokens(req, 0)
    req.status = None
    side.request_finished(req, [])
    side.update_state_after_alloc(req, _alloc([]), 0)
    assert _step(side).pool_loads == {}


def test_a_salted_requests_tier_blocks_are_named_under_its_salt() -> None:
    """The router matches a salted prompt's tier blocks by salted names only: another
    salt's (or no salt's) prompt of the same tokens never plans a load or a pool pull of
    them (vLLM's own hashes, which key the tier's slots, differ as well)."""
    side = SchedulerSide(CONFIG, BS, _host(2))
    req = _request("a", 2 * BS)
    req.cache_salt = "tenant-a"
    side.request_finished(req, [7, 8])
    _done(side, sending={"a"})
    salted = chain_hashes(req.all_token_ids[:2 * BS], BS, salt_root("tenant-a"))
    assert side.take_events() == [("host", True, tier_hashes(salted, "host"))]
    assert salted != chain_hashes(req.all_token_ids[:2 * BS], BS)


def test_the_tiers_residency_and_counters_go_to_the_router_and_the_worker() -> None:
    side = SchedulerSide(CONFIG, BS, _host(2))
    req = _request("a", 2 * BS)
    side.request_finished(req, [7, 8])
    assert side.take_events() == []  # not matchable until the save is done
    _done(side, sending={"a"})
    names = chain_hashes(req.all_token_ids[:2 * BS], BS)
    assert side.take_events() == [("host", True, tier_hashes(names, "host"))]
    other = _request("b", 3 * BS)
    other.block_hashes = [_h(2000 + i) for i in range(3)]
    other.all_token_ids = list(range(5000, 5000 + 3 * BS))
    side.request_finished(other, [1, 2, 3])  # evicts a's blocks (only 2 slots)
    _done(side, sending={"b"})
    events = side.take_events()
    assert events[0] == ("host", False, tier_hashes(names, "host"))
    assert events[1] == ("host", True, tier_hashes(
        chain_hashes(other.all_token_ids[:2 * BS], BS), "host"))
    # The miss count: 3 loadable blocks, the host tier holds b's first 2 (a's are gone).
    miss = _request("m", 3 * BS + 1, computed=0)
    miss.block_hashes = [_h(2000), _h(2001), _h(5)]
    assert side.get_num_new_matched_tokens(miss, 0) == (2 * BS, True)
    side.update_state_after_alloc(miss, _alloc([30, 31]), 2 * BS)
    assert _step(side).tier_counts == {"tier_miss_blocks": 1, "tier_evictions": 2}


def test_a_pool_load_runs_on_the_worker_side_and_counts() -> None:
    from pdserve.kv_transfer.metadata import PdserveConnectorMetadata, PoolLoad
    from pdserve.kv_transfer.worker_side import WorkerSide

    pair = _Pair("tcp")
    side = WorkerSide(CONFIG, {}, 0, 16, NUM_BLOCKS)
    side._transport.close()
    side._transport = pair.client  # the pulling worker's transport, already started
    side._io._transport = pair.client  # the pool pulls through it
    try:
        pair.save([3, 4], [0, 1], [_h(3), _h(4)])
        meta = PdserveConnectorMetadata(pool_loads={
            "r": PoolLoad("127.0.0.1", pair.port, (_h(3), _h(4)), (11, 12))},
            tier_counts={"tier_miss_blocks": 3})
        side.start_step(meta)
        _, recving, failed = _poll_until(side, "r")
        assert (recving, failed) == ({"r"}, set())
        stats = side._status_extra()
        assert (stats["pool_loads"], stats["pool_load_blocks"], stats["tier_miss_blocks"]
                ) == (1, 2, 3)
        assert torch.equal(pair.dst["layer.0"][12], pair.src["layer.0"][4])
        side.start_step(PdserveConnectorMetadata(pool_loads={
            "s": PoolLoad("127.0.0.1", pair.port, (_h(9),), (13,))}))
        _, recving, failed = _poll_until(side, "s")
        assert failed == {"s"} and side._status_extra()["pool_load_failures"] == 1
    finally:
        side._pool.shutdown(wait=True)
        pair.close()


def _poll_until(side: Any, req_id: str) -> tuple[set[str], set[str], set[str]]:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        sending, recving, failed = side.poll()
        if req_id in recving:
            return sending, recving, failed
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished")





def test_after_a_failed_pool_load_the_request_computes_and_never_asks_the_peer_again() -> None:
    side = SchedulerSide(CONFIG, BS, None)
    req = _pool_request("g", 4 * BS)
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    side.update_state_after_alloc(req, _alloc([1, 2, 3]), 3 * BS)
    assert "g" in _step(side).pool_loads
    _done(side, recving={"g"}, failed={"g"})  # vLLM recomputes the blocks
    assert side.get_num_new_matched_tokens(req, 0) == (0, False)
    req.status = None
    side.request_finished(req, [])
    assert side.get_num_new_matched_tokens(req, 0) == (3 * BS, True)  # a new request


def test_a_request_aborted_while_queued_or_mid_pull_leaves_nothing_behind() -> None:
    side = SchedulerSide(CONFIG, BS, _host(4))
    queued = _pool_request("q", 4 * BS)
    side.get_num_new_matched_tokens(queued, 0)  # matched (a miss counted), never allocated
    queued.status = None
    side.request_finished(queued, [])
    pulling = _pool_request("p", 4 * BS)
    side.get_num_new_matched_tokens(pulling, 0)
    side.update_state_after_alloc(pulling, _alloc([1, 2, 3]), 3 * BS)
    _step(side)
    pulling.status = None
    side.request_finished(pulling, [1, 2, 3])  # aborted while its pull runs
    _done(side, recving={"p"}, failed={"p"})  # the pull's failure arrives after
    tiers = side.tiers
    assert tiers is not None and not tiers._misses and not tiers._matched
    assert not (side._pool_matched or side._pool_loading or side._pool_failed)


def test_no_pool_over_nccl() -> None:
    from pdserve.kv_transfer.worker_side import pool_transport_ok

    assert pool_transport_ok("torch", "cpu") and pool_transport_ok("tcp", "cuda")
    assert not pool_transport_ok("torch", "cuda")
