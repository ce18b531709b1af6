"""``KVStore`` on Redis (``redis://HOST:PORT[/DB]``) and Redis Cluster
(``redis-cluster://HOST:PORT[,HOST:PORT...]``), with the ``redis`` package's sync client.

Sync on purpose: the connector's saves and loads run on its own threads (never on an
engine step), and one pipeline per call is one round trip either way. Each call is one
non-transactional pipeline: ``lookup_prefix`` one EXISTS per name, ``get_blocks`` one GET
per name, ``put_blocks`` one ``SET NX PX`` per block. In cluster mode a prompt's keys
share a hash tag (``names.py``), so the pipeline goes to one shard: still one round trip.

Deadlines: ``socket_connect_timeout`` and ``socket_timeout`` are the options' timeout,
and redis-py's retries are off (``Retry(NoBackoff(), 0)``), so a call waits at most about
``timeout_s`` for any byte; a server that keeps sending slowly is not cut off (a large
value is bounded by its size over the link's rate, plus ``timeout_s`` per stall).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import RedisClusterException, RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from pdserve.kv_transfer.remote import codec
from pdserve.kv_transfer.remote.base import StoreError, StoreOptions, StoreTimeoutError
from pdserve.kv_transfer.remote.names import BlockName

STATS = ("lookups", "lookup_blocks", "lookup_hit_blocks", "gets", "get_blocks",
         "get_hit_blocks", "get_bytes", "bad_blocks", "puts", "put_blocks", "put_written",
         "put_bytes", "errors", "timeouts")


class RedisKVStore:
    """One client (a ``redis.Redis`` or a ``RedisCluster``) shared by the caller's
    threads (redis-py's pools are thread-safe); counters under a lock."""

    def __init__(self, client: Any, where: str) -> None:
        self._client = client
        self._where = where
        self._stats = dict.fromkeys(STATS, 0)
        self._lock = threading.Lock()

    def lookup_prefix(self, names: Sequence[BlockName]) -> int:
        replies = self._pipeline("lookup", [("exists", n.key) for n in names])
        held = 0
        for reply in replies:
            if not reply:
                break
            held += 1
        self._count(lookups=1, lookup_blocks=len(names), lookup_hit_blocks=held)
        return held

    def get_blocks(self, names: Sequence[BlockName]) -> list[memoryview | None]:
        replies = self._pipeline("get", [("get", n.key) for n in names])
        out: list[memoryview | None] = []
        bad = hits = nbytes = 0
        for name, value in zip(names, replies, strict=True):
            payload = None if value is None else codec.decode(name.key, value)
            bad += value is not None and payload is None
            if payload is not None:
                hits += 1
                nbytes += len(payload)
            out.append(payload)
        self._count(gets=1, get_blocks=len(names), get_hit_blocks=hits, bad_blocks=bad,
                    get_bytes=nbytes)
        return out

    def put_blocks(self, items: Sequence[tuple[BlockName, bytes | memoryview]],
                   ttl_s: float) -> int:
        ttl_ms = int(ttl_s * 1000)
        if ttl_ms < 1:
            raise ValueError(f"ttl_s must be >= 0.001, not {ttl_s}")
        ops = [("set", name.key, codec.encode(name.key, payload), ttl_ms)
               for name, payload in items]
        written = sum(1 for ok in self._pipeline("put", ops) if ok)
        self._count(puts=1, put_blocks=len(items), put_written=written,
                    put_bytes=sum(len(p) for _, p in items))
        return written

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        try:
            self._client.close()
        except (RedisError, RedisClusterException, OSError):
            pass  # closing a broken connection: nothing left to end

    def _pipeline(self, what: str, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        if not ops:
            return []
        try:
            pipe = self._client.pipeline(transaction=False)
            for op in ops:
                if op[0] == "set":
                    pipe.set(op[1], op[2], nx=True, px=op[3])
                else:
                    getattr(pipe, op[0])(op[1])
            return list(pipe.execute())
        except RedisTimeoutError as exc:
            self._count(errors=1, timeouts=1)
            raise StoreTimeoutError(f"KV store {self._where}: {what} timed out: {exc}"
                                    ) from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            self._count(errors=1)
            raise StoreError(f"KV store {self._where}: {what} failed: "
                             f"{type(exc).__name__}: {exc}") from exc

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._stats[key] += value


def open_redis(url: str, options: StoreOptions) -> RedisKVStore:
    """The store at ``url`` (``redis://`` or ``redis-cluster://``); a cluster is asked
    for its slots now (``StoreError`` if no node answers), a single server on first use."""
    timeouts: dict[str, Any] = {"socket_timeout": options.timeout_s,
                                "socket_connect_timeout": options.timeout_s,
                                "retry": Retry(NoBackoff(), 0)}
    parts = urlsplit(url)
    if parts.scheme == "redis":
        return RedisKVStore(redis.Redis.from_url(url, **timeouts), parts.netloc)
    if parts.scheme != "redis-cluster":
        raise ValueError(f"not a Redis URL: {url!r}")
    nodes = [_node(part, url) for part in parts.netloc.split(",")]
    try:
        client = RedisCluster(startup_nodes=nodes, **timeouts)
    except (RedisError, RedisClusterException, OSError) as exc:
        raise StoreError(f"KV store {parts.netloc}: no cluster node answered: {exc}"
                         ) from exc
    return RedisKVStore(client, parts.netloc)


def _node(hostport: str, url: str) -> ClusterNode:
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"redis-cluster URL {url!r}: {hostport!r} is not HOST:PORT")
    return ClusterNode(host, int(port))
