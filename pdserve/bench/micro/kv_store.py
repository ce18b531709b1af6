"""``pdserve bench kv-store``: the cluster KV store's SET and GET GiB/s on loopback,
beside a memcpy of the same bytes.

For each ``--value-mib`` size it writes ``--total-mib`` of values through the store
(``put_blocks``: SET NX PX, the checked header added; ``--batch-mib`` per call, one
round trip each) and reads them back (``get_blocks``: GET, the checksum verified); on a
``redis://`` server also with redis-py's bare pipelines (no header, no check), the cost
of the store's own layer. Each repetition writes new names (a held name is never
rewritten). One JSON line per (size, operation): the median GiB/s over ``--reps``, and
whether the connection was TLS.
Without ``--url`` a local redis-server (no persistence, a memory cap) runs for it, over
mutual TLS with ``--tls`` (a throwaway CA in a temporary folder): beside a run without
it, what TLS costs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import redis

from pdserve.bench.micro.configs import KvStoreConfig
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.remote.base import KVStore, StoreError, StoreOptions, create_store
from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.kv_transfer.remote.names import BlockName, KVIdentity

_MIB = 1 << 20
_TTL_S = 120.0  # values left on an external server go away by themselves


def run(config: KvStoreConfig) -> int:
    lines: list[str] = []
    try:
        with _server(config) as (url, tls):
            store = create_store(url, StoreOptions(timeout_s=10.0, tls=tls))
            raw = _raw_client(url, tls)
            try:
                for mib in config.value_mib:
                    for row in _measure(config, store, raw, mib):
                        lines.append(json.dumps({**row, "tls": url.startswith("rediss")}))
                        print(lines[-1], flush=True)
            finally:
                store.close()
                if raw is not None:
                    raw.close()
    except (StoreError, RuntimeError, ValueError) as exc:
        print(f"pdserve bench kv-store: error: {exc}", file=sys.stderr)
        return 1
    if config.json:
        Path(config.json).write_text("".join(f"{line}\n" for line in lines))
    return 0


@contextlib.contextmanager
def _server(config: KvStoreConfig) -> Iterator[tuple[str, TlsFiles]]:
    """The store's URL and TLS files (none: plaintext, or an external one's system roots)."""
    if config.url:
        yield config.url, TlsFiles()
        return
    cap = f"{2 * config.total_mib + 2 * config.batch_mib + 64}mb"  # one size's values, twice
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-kv-store-") as folder:
        tls = make_test_ca(Path(folder)) if config.tls else None
        with LocalRedis(maxmemory=cap, tls=tls) as server:
            yield server.url, tls or TlsFiles()


def _raw_client(url: str, tls: TlsFiles) -> redis.Redis | None:
    """A bare client of a single server (a cluster: None), over TLS for ``rediss://``."""
    if url.startswith("redis://"):
        return redis.Redis.from_url(url)
    if url.startswith("rediss://"):
        return redis.Redis.from_url(url, ssl_certfile=tls.cert, ssl_keyfile=tls.key,
                                    ssl_ca_certs=tls.ca)
    return None


def _measure(config: KvStoreConfig, store: KVStore, raw: redis.Redis | None,
             mib: float) -> list[dict[str, object]]:
    size = max(1, int(mib * _MIB))
    count = max(1, config.total_mib * _MIB // size)
    per_call = max(1, config.batch_mib * _MIB // size)
    payload = os.urandom(size)
    times: dict[str, list[float]] = {"set": [], "get": [], "memcpy": []}
    if raw is not None:
        times |= {"raw_set": [], "raw_get": []}
    for _ in range(config.reps):
        names = KVIdentity(f"bench-{os.urandom(8).hex()}", "default", "bench", "bench",
                           16).names(list(range(1, count + 1)))
        batches = [names[i:i + per_call] for i in range(0, count, per_call)]
        times["set"].append(_timed(functools.partial(_put, store, batches, payload)))
        times["get"].append(_timed(functools.partial(_get, store, batches, size)))
        times["memcpy"].append(_timed(functools.partial(_memcpy, payload, count)))
        if raw is not None:
            times["raw_set"].append(_timed(functools.partial(_raw, raw, batches, payload)))
            times["raw_get"].append(_timed(functools.partial(_raw, raw, batches, None)))
        _forget(raw, names)
    gib = count * size / (1 << 30)
    return [{"value_mib": mib, "values": count, "per_call": per_call, "op": op,
             "gib_s": round(gib / statistics.median(ts), 3),
             "median_s": round(statistics.median(ts), 4)} for op, ts in times.items()]


def _timed(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _memcpy(payload: bytes, count: int) -> None:
    """``count`` copies of the value into one preallocated buffer (as a load copies a
    block into the engine's cache)."""
    dst = memoryview(bytearray(len(payload)))
    for _ in range(count):
        dst[:] = payload


def _put(store: KVStore, batches: list[list[BlockName]], payload: bytes) -> None:
    for batch in batches:
        if store.put_blocks([(n, payload) for n in batch], _TTL_S) != len(batch):
            raise RuntimeError("the store refused new values (full? --total-mib too large)")


def _get(store: KVStore, batches: list[list[BlockName]], size: int) -> None:
    for batch in batches:
        if any(v is None or len(v) != size for v in store.get_blocks(batch)):
            raise RuntimeError("a value written was not read back (evicted?)")


def _raw(client: redis.Redis, batches: list[list[BlockName]], payload: bytes | None) -> None:
    for batch in batches:
        pipe = client.pipeline(transaction=False)
        for name in batch:
            if payload is None:
                pipe.get(name.key + ":raw")
            else:
                pipe.set(name.key + ":raw", payload, px=int(_TTL_S * 1000))
        pipe.execute()


def _forget(raw: redis.Redis | None, names: list[BlockName]) -> None:
    """Delete a repetition's values (a local or single server: the next one's room)."""
    if raw is None:
        return  # a cluster: the TTL removes them
    for i in range(0, len(names), 1000):
        chunk = names[i:i + 1000]
        raw.delete(*(n.key for n in chunk), *(n.key + ":raw" for n in chunk))
