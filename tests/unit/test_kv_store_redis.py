"""The cluster KV store on a real redis-server, started once for the module on loopback
(Redis Cluster: test_kv_store_redis_cluster.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest
from unit.kv_store_helpers import fresh_names, random_blocks

from pdserve.kv_transfer.remote.base import (
    StoreError,
    StoreOptions,
    StoreTimeoutError,
    create_store,
)
from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.kv_transfer.remote.names import KVIdentity
from pdserve.kv_transfer.remote.redis_store import RedisKVStore

_names, _blocks = fresh_names, random_blocks


@pytest.fixture(scope="module")
def server() -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory="64mb") as redis_server:
        yield redis_server


@pytest.fixture
def store(server: LocalRedis) -> Iterator[RedisKVStore]:
    s = create_store(server.url, StoreOptions(timeout_s=0.5))
    assert isinstance(s, RedisKVStore)
    yield s
    s.close()


def test_the_launcher_caps_memory_and_keeps_nothing_on_disk(server: LocalRedis) -> None:
    with server.client() as c:
        config = c.config_get("*")
    assert config["maxmemory"] == str(64 << 20)
    assert config["maxmemory-policy"] == "allkeys-lru"
    assert config["save"] == "" and config["appendonly"] == "no"


def test_put_then_get_is_bit_exact(store: RedisKVStore) -> None:
    names, blocks = _names(4), _blocks(4, 1 << 20)
    before = store.stats()
    assert store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60) == 4
    got = store.get_blocks(names)
    assert [bytes(b) if b is not None else None for b in got] == blocks
    after = store.stats()
    assert after["get_hit_blocks"] - before["get_hit_blocks"] == 4
    assert after["put_written"] - before["put_written"] == 4


def test_lookup_counts_only_the_contiguous_prefix(store: RedisKVStore) -> None:
    names, blocks = _names(6), _blocks(6)
    assert store.lookup_prefix(names) == 0
    held = [0, 1, 2, 4, 5]  # a hole at 3
    store.put_blocks([(names[i], blocks[i]) for i in held], ttl_s=60)
    assert store.lookup_prefix(names) == 3
    assert store.lookup_prefix(names[4:]) == 2
    assert [b is not None for b in store.get_blocks(names)] == [True] * 3 + [False, True, True]


def test_a_published_block_keeps_its_first_value(store: RedisKVStore) -> None:
    [name] = _names(1)
    assert store.put_blocks([(name, b"first")], ttl_s=60) == 1
    assert store.put_blocks([(name, b"second")], ttl_s=60) == 0
    assert bytes(store.get_blocks([name])[0] or b"") == b"first"


def test_a_block_expires_after_its_ttl(store: RedisKVStore) -> None:
    [name] = _names(1)
    store.put_blocks([(name, b"soon gone")], ttl_s=0.2)
    assert store.lookup_prefix([name]) == 1
    time.sleep(0.3)
    assert store.lookup_prefix([name]) == 0 and store.get_blocks([name]) == [None]


def test_other_identities_never_see_a_block(store: RedisKVStore) -> None:
    names = _names(2)
    store.put_blocks([(n, b"kv") for n in names], ttl_s=60)
    hashes = [n.block_hash for n in names]
    for other in (KVIdentity("fp0", "v2", "bfloat16", "cpu", 16, (2, 16, 128)),
                  KVIdentity("fp0", "default", "bfloat16", "cpu", 16, (2, 16, 128), "t1"),
                  KVIdentity("fp0", "default", "float32", "cpu", 16, (2, 16, 128))):
        assert store.lookup_prefix(other.names(hashes)) == 0


def test_a_corrupted_value_is_a_counted_miss(server: LocalRedis, store: RedisKVStore) -> None:
    names, blocks = _names(3), _blocks(3)
    store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60)
    with server.client() as raw:
        value = bytearray(raw.get(names[1].key) or b"")
        value[-1] ^= 0xFF
        raw.set(names[1].key, bytes(value))
        raw.set(names[2].key, raw.get(names[0].key) or b"")  # a valid value, wrong key
    before = store.stats()
    got = store.get_blocks(names)
    assert bytes(got[0] or b"") == blocks[0] and got[1:] == [None, None]
    assert store.stats()["bad_blocks"] - before["bad_blocks"] == 2
    # both deleted: the next writer publishes good values (SET NX no longer refused)
    assert store.stats()["bad_deleted"] - before["bad_deleted"] == 2
    with server.client() as raw:
        assert raw.exists(names[1].key, names[2].key) == 0
    assert store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60) == 2
    assert [bytes(b or b"") for b in store.get_blocks(names)] == blocks


def test_a_bad_value_is_deleted_only_while_the_store_still_holds_it(
        server: LocalRedis, store: RedisKVStore) -> None:
    names, blocks = _names(2), _blocks(2)
    store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60)
    got = store.get_blocks(names)
    before = store.stats()["bad_deleted"]
    # the first: found bad past its checksum (its encoding), still the same value
    assert store.discard([(names[0], got[0] or memoryview(b""))]) == 1
    # the second: replaced since (expired, published again): the new value stays
    with server.client() as raw:
        raw.delete(names[1].key)
    store.put_blocks([(names[1], b"a newer good value")], ttl_s=60)
    assert store.discard([(names[1], got[1] or memoryview(b""))]) == 0
    assert store.stats()["bad_deleted"] - before == 1
    assert store.lookup_prefix(names) == 0
    assert bytes(store.get_blocks(names[1:])[0] or b"") == b"a newer good value"


def test_a_stopped_server_fails_the_call_within_its_deadline(server: LocalRedis,
                                                             store: RedisKVStore) -> None:
    names = _names(2)
    store.put_blocks([(n, b"kv") for n in names], ttl_s=60)  # connected
    before = store.stats()
    server.send_signal(signal.SIGSTOP)
    try:
        for call in (lambda: store.lookup_prefix(names), lambda: store.get_blocks(names),
                     lambda: store.put_blocks([(names[0], b"x")], ttl_s=60)):
            start = time.monotonic()
            with pytest.raises(StoreTimeoutError):
                call()
            assert time.monotonic() - start < 0.5 + 0.5  # the deadline and some slack
    finally:
        server.send_signal(signal.SIGCONT)
    after = store.stats()
    assert after["timeouts"] - before["timeouts"] == 3
    assert store.lookup_prefix(names) == 2  # the next call reconnects


def test_an_unreachable_server_is_a_store_error() -> None:
    with LocalRedis() as gone:
        url = gone.url
    s = create_store(url, StoreOptions(timeout_s=0.5))
    with pytest.raises(StoreError):
        s.lookup_prefix(_names(1))


def test_a_full_store_refuses_writes_or_evicts_by_its_policy() -> None:
    value = os.urandom(256 << 10)
    with LocalRedis(maxmemory="4mb", policy="noeviction") as full:
        store = create_store(full.url, StoreOptions(timeout_s=1.0))
        before = store.stats()
        with pytest.raises(StoreError, match="OutOfMemoryError: command not allowed when "
                           "used memory > 'maxmemory'.$"):  # no block bytes in it
            for _ in range(40):  # 10 MiB into 4
                store.put_blocks([(_names(1)[0], value)], ttl_s=60)
        assert store.stats()["errors"] - before["errors"] == 1
        store.close()
    with LocalRedis(maxmemory="4mb", policy="allkeys-lru") as lru:
        store = create_store(lru.url, StoreOptions(timeout_s=1.0))
        names = [_names(1)[0] for _ in range(40)]
        for name in names:
            assert store.put_blocks([(name, value)], ttl_s=60) == 1
        held = [store.lookup_prefix([n]) for n in names]
        assert held[-1] == 1 and 0 < sum(held) < len(names)  # the oldest evicted
        store.close()
