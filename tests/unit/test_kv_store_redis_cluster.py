"""The cluster KV store on a 3-shard Redis Cluster on loopback (started once for the
module; the killed-shard test starts its own)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from unit.kv_store_helpers import fresh_names, random_blocks

from pdserve.kv_transfer.remote.base import (
    StoreError,
    StoreOptions,
    StoreTimeoutError,
    create_store,
)
from pdserve.kv_transfer.remote.local_redis import LocalRedis, LocalRedisCluster

_names, _blocks = fresh_names, random_blocks


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalRedisCluster]:
    with LocalRedisCluster(masters=3, maxmemory="32mb") as c:  # ~2 s on 2 cores
        yield c


def test_a_cluster_serves_a_prompts_blocks_from_one_shard(cluster: LocalRedisCluster) -> None:
    store = create_store(cluster.url, StoreOptions(timeout_s=1.0))
    try:
        prompts = [(_names(5), _blocks(5)) for _ in range(12)]
        for names, blocks in prompts:
            assert store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60) == 5
        shards_used = set()
        for names, blocks in prompts:
            assert store.lookup_prefix(names) == 5
            assert [bytes(b or b"") for b in store.get_blocks(names)] == blocks
            with cluster.nodes[0].client() as c:
                slots = {c.cluster("keyslot", name.key) for name in names}
            assert len(slots) == 1  # the whole prompt in one slot, so on one shard
            shards_used.add(_holder(cluster, slots.pop()))
        assert len(shards_used) > 1  # and prompts spread over the shards
    finally:
        store.close()


def _holder(cluster: LocalRedisCluster, slot: int) -> int:
    """The port of the node whose keys fill ``slot``."""
    holders = []
    for node in cluster.nodes:
        with node.client() as c:
            if c.cluster("countkeysinslot", slot):
                holders.append(node.port)
    assert len(holders) == 1
    return holders[0]


class _Executes:
    """Counts pipeline round trips (``Pipeline.execute`` calls) while installed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        real = redis.client.Pipeline.execute

        def execute(pipe: redis.client.Pipeline, *args: Any, **kwargs: Any) -> object:
            self.count += 1
            return real(pipe, *args, **kwargs)

        monkeypatch.setattr(redis.client.Pipeline, "execute", execute)


def _exists_calls(node: LocalRedis) -> int:
    with node.client() as c:
        return int(c.info("commandstats").get("cmdstat_exists", {}).get("calls", 0))


def test_each_call_is_one_round_trip_to_one_shard(cluster: LocalRedisCluster,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    store = create_store(cluster.url, StoreOptions(timeout_s=1.0))
    try:
        names, blocks = _names(8), _blocks(8)
        executes = _Executes(monkeypatch)
        store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60)
        before = [_exists_calls(n) for n in cluster.nodes]
        assert store.lookup_prefix(names) == 8
        store.get_blocks(names)
        assert executes.count == 3
        deltas = sorted(_exists_calls(n) - b for n, b in zip(cluster.nodes, before,
                                                                strict=True))
        assert deltas == [0, 0, 8]
    finally:
        store.close()


def test_a_corrupt_value_on_a_shard_is_deleted_there(cluster: LocalRedisCluster) -> None:
    store = create_store(cluster.url, StoreOptions(timeout_s=1.0))
    raw = redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)
    try:
        names, blocks = _names(3), _blocks(3)
        assert store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60) == 3
        stored = raw.get(names[1].key)
        assert isinstance(stored, bytes)
        value = bytearray(stored)
        value[-1] ^= 0x01
        raw.set(names[1].key, bytes(value))
        before = store.stats()["bad_deleted"]
        got = store.get_blocks(names)
        assert got[1] is None and bytes(got[0] or b"") == blocks[0]
        assert store.stats()["bad_deleted"] - before == 1
        assert raw.exists(names[1].key) == 0 and raw.exists(names[2].key) == 1
    finally:
        raw.close()
        store.close()


def test_a_stopped_shard_fails_only_its_prompts_within_the_deadline(
        cluster: LocalRedisCluster) -> None:
    store = create_store(cluster.url, StoreOptions(timeout_s=0.5))
    try:
        prompts = [_names(3) for _ in range(12)]
        for names in prompts:
            store.put_blocks([(n, b"kv") for n in names], ttl_s=60)
        victim = cluster.nodes[0]
        with victim.client() as c:
            on_victim = [bool(c.cluster("countkeysinslot", c.cluster("keyslot", p[0].key)))
                         for p in prompts]
        assert any(on_victim) and not all(on_victim)
        victim.send_signal(signal.SIGSTOP)
        try:
            for names, stopped in zip(prompts, on_victim, strict=True):
                start = time.monotonic()
                if stopped:
                    with pytest.raises(StoreTimeoutError):
                        store.lookup_prefix(names)
                else:
                    assert store.lookup_prefix(names) == 3
                assert time.monotonic() - start < 0.5 + 0.5
        finally:
            victim.send_signal(signal.SIGCONT)
        assert [store.lookup_prefix(names) for names in prompts] == [3] * len(prompts)
    finally:
        store.close()


def test_a_killed_shard_loses_only_its_prompts() -> None:
    with LocalRedisCluster(masters=3, maxmemory="16mb") as own:
        store = create_store(own.url, StoreOptions(timeout_s=0.5))
        prompts = [_names(2) for _ in range(12)]
        for names in prompts:
            store.put_blocks([(n, b"kv") for n in names], ttl_s=60)
        victim = own.nodes[0]
        with victim.client() as c:
            lost = [bool(c.cluster("countkeysinslot", c.cluster("keyslot", p[0].key)))
                    for p in prompts]
        victim.stop()
        before = store.stats()
        for wait_s in (2.5, 0):  # at once, and once the others marked it failed (after 2 s)
            for names, gone in zip(prompts, lost, strict=True):
                start = time.monotonic()
                if gone:
                    with pytest.raises(StoreError):
                        store.lookup_prefix(names)
                else:
                    assert store.lookup_prefix(names) == 2
                assert time.monotonic() - start < 0.5 + 0.5
            time.sleep(wait_s)
        assert store.stats()["errors"] - before["errors"] == 2 * sum(lost)
        store.close()
