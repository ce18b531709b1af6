"""``KVStore`` on Redis (``redis://HOST:PORT[/DB]``) and Redis Cluster
(``redis-cluster://HOST:PORT[,HOST:PORT...]``), with the ``redis`` package's sync client;
over TLS with ``rediss://`` and ``rediss-cluster://`` (``base.py``: what is verified).

Sync on purpose: the connector's saves and loads run on its own threads (never on an
engine step), and one pipeline per call is one round trip either way. Each call is one
non-transactional pipeline per server: ``lookup_prefix`` one EXISTS per name,
``get_blocks`` one GET per name, ``put_blocks`` one ``SET NX PX`` per block. A value
``get_blocks`` finds corrupt (or ``discard`` is given) is deleted in a second round trip
by a script that deletes the key only while it holds that value (its SHA-1 compared on
the server: a good value published after the bad one expired stays).

In cluster mode a prompt's keys share a hash tag (``names.py``), so they are one slot on
one shard, and the store sends them as one plain pipeline to the node that owns the slot
(``_ClusterTargets``): one round trip. Not redis-py's ``ClusterPipeline``: on a timeout it
resends each failed command alone (a stopped shard then costs a deadline per command,
measured 2 s for a 0.5 s deadline and three blocks). Names of several prompts in one call
go to each owner in turn. A connection error or a redirect (MOVED/ASK: a slot moved, a
replica took over) fails the call (``StoreError``) and the next call first reloads the
slot table.

Deadlines: ``socket_connect_timeout`` and ``socket_timeout`` are the options' timeout,
and redis-py's retries are off (``Retry(NoBackoff(), 0)``), so a call waits at most about
``timeout_s`` for any byte; a server that keeps sending slowly is not cut off (a large
value is bounded by its size over the link's rate, plus ``timeout_s`` per stall).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import AskError, MovedError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from pdserve.kv_transfer.remote import codec
from pdserve.kv_transfer.remote.base import (
    TLS_SCHEMES,
    StoreError,
    StoreOptions,
    StoreTimeoutError,
)
from pdserve.kv_transfer.remote.names import BlockName

STATS = ("lookups", "lookup_blocks", "lookup_hit_blocks", "gets", "get_blocks",
         "get_hit_blocks", "get_bytes", "bad_blocks", "bad_deleted", "puts", "put_blocks",
         "put_written", "put_bytes", "errors", "timeouts")

# KEYS[1] deleted only while it holds the value whose SHA-1 is ARGV[1]; 1 if deleted.
_DELETE_IF_SAME = ("local v = redis.call('GET', KEYS[1]) "
                   "if v and redis.sha1hex(v) == ARGV[1] then "
                   "return redis.call('DEL', KEYS[1]) end return 0")


class _SingleTarget:
    """Every key on one server."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def groups(self, keys: Sequence[str]) -> list[tuple[redis.Redis, list[int]]]:
        return [(self.client, list(range(len(keys))))]

    def failed(self, exc: Exception) -> None:
        pass

    def close(self) -> None:
        self.client.close()


class _ClusterTargets:
    """Keys grouped by the node that owns their slot, in the order first seen; the slot
    table reloaded before the next call after a connection error or a redirect."""

    def __init__(self, client: RedisCluster) -> None:
        self.client = client
        self._stale = False

    def groups(self, keys: Sequence[str]) -> list[tuple[redis.Redis, list[int]]]:
        if self._stale:
            self.client.nodes_manager.initialize()
            self._stale = False
        by_node: dict[str, tuple[redis.Redis, list[int]]] = {}
        for i, key in enumerate(keys):
            node = self.client.get_node_from_key(key)
            if node.name not in by_node:
                by_node[node.name] = (self.client.get_redis_connection(node), [])
            by_node[node.name][1].append(i)
        return list(by_node.values())

    def failed(self, exc: Exception) -> None:
        if isinstance(exc, RedisConnectionError | MovedError | AskError):
            self._stale = True

    def close(self) -> None:
        self.client.close()


class RedisKVStore:
    """One client (a ``redis.Redis`` or a ``RedisCluster``) shared by the caller's
    threads (redis-py's pools are thread-safe); counters under a lock."""

    def __init__(self, client: redis.Redis | RedisCluster, where: str) -> None:
        self._targets: _SingleTarget | _ClusterTargets = (
            _ClusterTargets(client) if isinstance(client, RedisCluster)
            else _SingleTarget(client))
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
        bad: list[tuple[str, bytes]] = []
        hits = nbytes = 0
        for name, value in zip(names, replies, strict=True):
            payload = None if value is None else codec.decode(name.key, value)
            if value is not None and payload is None:
                bad.append((name.key, value))
            if payload is not None:
                hits += 1
                nbytes += len(payload)
            out.append(payload)
        self._count(gets=1, get_blocks=len(names), get_hit_blocks=hits,
                    bad_blocks=len(bad), get_bytes=nbytes)
        if bad:
            try:
                self._delete(bad)
            except StoreError:
                pass  # counted; the bad value expires with its TTL
        return out

    def discard(self, items: Sequence[tuple[BlockName, memoryview]]) -> int:
        return self._delete([(name.key, codec.encode(name.key, payload))
                             for name, payload in items])

    def _delete(self, values: Sequence[tuple[str, bytes]]) -> int:
        """Delete each key that still holds its value; how many were."""
        ops = [("eval", key, hashlib.sha1(value, usedforsecurity=False).hexdigest())
               for key, value in values]
        deleted = sum(1 for reply in self._pipeline("delete", ops) if reply == 1)
        self._count(bad_deleted=deleted)
        return deleted

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
            self._targets.close()
        except (RedisError, RedisClusterException, OSError):
            pass  # closing a broken connection: nothing left to end

    def _pipeline(self, what: str, ops: Sequence[tuple[Any, ...]]) -> list[Any]:
        if not ops:
            return []
        replies: list[Any] = [None] * len(ops)
        try:
            for client, indices in self._targets.groups([op[1] for op in ops]):
                pipe = client.pipeline(transaction=False)
                for i in indices:
                    op = ops[i]
                    if op[0] == "set":
                        pipe.set(op[1], op[2], nx=True, px=op[3])
                    elif op[0] == "eval":
                        pipe.eval(_DELETE_IF_SAME, 1, op[1], op[2])
                    else:
                        getattr(pipe, op[0])(op[1])
                for i, reply in zip(indices, pipe.execute(), strict=True):
                    replies[i] = reply
            return replies
        except (RedisError, RedisClusterException, OSError) as exc:
            self._targets.failed(exc)
            raise self._error(what, exc) from exc

    def _error(self, what: str, exc: Exception) -> StoreError:
        # redis-py names a pipeline's failed command with its arguments: a block's bytes
        why = str(exc).rsplit("caused error: ", 1)[-1][:200]
        why = why.encode("ascii", "backslashreplace").decode()
        if isinstance(exc, RedisTimeoutError):
            self._count(errors=1, timeouts=1)
            return StoreTimeoutError(f"KV store {self._where}: {what} timed out: {why}")
        self._count(errors=1)
        return StoreError(f"KV store {self._where}: {what} failed: "
                          f"{type(exc).__name__}: {why}")

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for key, value in deltas.items():
                self._stats[key] += value


def open_redis(url: str, options: StoreOptions) -> RedisKVStore:
    """The store at ``url`` (``redis://``, ``redis-cluster://``, or over TLS ``rediss://``,
    ``rediss-cluster://``); a cluster is asked for its slots now (``StoreError`` if no
    node answers), a single server on first use."""
    parts = urlsplit(url)
    kwargs: dict[str, Any] = {"socket_timeout": options.timeout_s,
                              "socket_connect_timeout": options.timeout_s,
                              "retry": Retry(NoBackoff(), 0)}
    if options.password is not None:
        kwargs["password"] = options.password
    if parts.scheme in TLS_SCHEMES:  # rediss:// itself turns TLS on; a cluster's flag below
        kwargs |= _tls_kwargs(options)
    if parts.scheme in ("redis", "rediss"):
        return RedisKVStore(redis.Redis.from_url(url, **kwargs), parts.netloc)
    if parts.scheme not in ("redis-cluster", "rediss-cluster"):
        raise ValueError(f"not a Redis URL: {url!r}")
    nodes = [_node(part, url) for part in parts.netloc.split(",")]
    try:
        client = RedisCluster(startup_nodes=nodes, ssl=parts.scheme in TLS_SCHEMES,
                              **kwargs)
    except (RedisError, RedisClusterException, OSError) as exc:
        raise StoreError(f"KV store {parts.netloc}: no cluster node answered: {exc}"
                         ) from exc
    return RedisKVStore(client, parts.netloc)


def _tls_kwargs(options: StoreOptions) -> dict[str, Any]:
    """redis-py's TLS options: the server's certificate and name verified (against the
    CA file, else the system's roots), the client certificate when given; TLS 1.2 at
    least (``ssl.create_default_context``'s floor, which redis-py builds on)."""
    tls = options.tls
    tls.load()  # an unreadable file fails here, naming it, not at the first call
    return {"ssl_cert_reqs": "required", "ssl_check_hostname": True,
            "ssl_ca_certs": tls.ca, "ssl_certfile": tls.cert, "ssl_keyfile": tls.key}


def _node(hostport: str, url: str) -> ClusterNode:
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"redis-cluster URL {url!r}: {hostport!r} is not HOST:PORT")
    return ClusterNode(host, int(port))
