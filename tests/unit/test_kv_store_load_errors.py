"""A store block gone between the lookup and the load fails only what it must: the worker
side loads the host tier's blocks and the store's up to the gone one, reports the request
finished (not failed) and the blocks from the gone one on, the pool's after it included,
as vLLM's load errors, in the pass that reports the request (vLLM recomputes from there,
``kv_load_failure_policy="recompute"``, and keeps the prefix)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from unit.connector_fakes import poll_until_finished
from unit.kv_store_helpers import fresh_names

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.metadata import (
    NO_COPY,
    PdserveConnectorMetadata,
    PoolLoad,
    StoreCopy,
    TierCopy,
)
from pdserve.kv_transfer.remote.base import StoreOptions, create_store
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.kv_transfer.remote.worker import StoreWorker
from pdserve.kv_transfer.tiers.store import TierStore
from pdserve.kv_transfer.worker_side import WorkerSide

BS, NUM_BLOCKS = 4, 16


def _kv(seed: int) -> tuple[list[torch.Tensor], KVLayout]:
    gen = torch.Generator().manual_seed(seed)
    caches = {f"l{i}": torch.randn((NUM_BLOCKS, 2, BS, 8), generator=gen) for i in range(2)}
    return list(caches.values()), KVLayout.from_kv_caches(caches, NUM_BLOCKS, BS)


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory="16mb") as redis_server:
        yield redis_server


def _store_worker(url: str, kv: list[torch.Tensor], layout: KVLayout) -> StoreWorker:
    options = StoreOptions(timeout_s=0.5)
    return StoreWorker(lambda: create_store(url, options), kv, layout,
                       codec_for("none", layout), ttl_s=60)



def test_a_store_block_gone_at_load_fails_it_and_the_blocks_after_it_only(
        server: LocalRedis) -> None:
    src, src_layout = _kv(1)
    publisher = _store_worker(server.url, src, src_layout)
    names = tuple(fresh_names(4))
    try:
        assert publisher.save("p", StoreCopy((8, 9, 10, 11), names)) > 0
        assert publisher.flush(5.0)
    finally:
        publisher.close()
    server.client().delete(names[2].key)  # expired or evicted after the lookup

    kv, layout = _kv(2)
    side = WorkerSide(ConnectorConfig(engine_id="w"), {}, 0, BS, NUM_BLOCKS)
    side._io.tiers = TierStore(kv, layout, host_slots=2, verify=False, disk_dir=None,
                               disk_compat="")
    side._io.store = _store_worker(server.url, kv, layout)
    tier_hash = b"t" * 32
    side._io.tiers.save("earlier", TierCopy((12,), (0,), (tier_hash,)), NO_COPY)
    before = [t.clone() for t in kv]
    try:
        side.start_step(PdserveConnectorMetadata(
            tier_loads={"r": TierCopy((0,), (0,), (tier_hash,))},
            store_loads={"r": StoreCopy((1, 2, 3, 4), names)},
            pool_loads={"r": PoolLoad("127.0.0.1", 9, (b"p" * 32, b"q" * 32), (5, 6))}))
        recving, failed = poll_until_finished(side, "r")
        assert (recving, failed) == ({"r"}, set())  # finished, not failed: vLLM keeps
        assert side.take_load_errors() == {3, 4, 5, 6}  # ... the prefix before block 3
        assert side.take_load_errors() == set()  # reported once
        for layer, old, pub in zip(kv, before, src, strict=True):
            assert torch.equal(layer[0], old[12])  # the host tier's block
            assert torch.equal(layer[1:3], pub[8:10])  # the store's, up to the gone one
            assert torch.equal(layer[3:7], old[3:7])  # nothing written after it
        stats = side._status_extra()
        assert stats["store_load_blocks"] == 2 and stats["store_load_missing"] == 1
        assert stats["store_load_failures"] == 1 and stats["tier_loads"] == 1
        assert stats["pool_loads"] == stats["pool_load_failures"] == 0  # never pulled
    finally:
        side.shutdown()


def test_a_tier_that_fails_still_fails_the_whole_request(server: LocalRedis) -> None:
    kv, layout = _kv(3)
    side = WorkerSide(ConnectorConfig(engine_id="w"), {}, 0, BS, NUM_BLOCKS)
    side._io.tiers = TierStore(kv, layout, host_slots=2, verify=False, disk_dir=None,
                               disk_compat="")
    side._io.store = _store_worker(server.url, kv, layout)
    try:
        side.start_step(PdserveConnectorMetadata(
            tier_loads={"r": TierCopy((0,), (1,), (b"x" * 32,))},  # never saved
            store_loads={"r": StoreCopy((1, 2), tuple(fresh_names(2)))}))
        assert poll_until_finished(side, "r") == ({"r"}, {"r"})
        assert side.take_load_errors() == set()  # vLLM recomputes it all
    finally:
        side.shutdown()
