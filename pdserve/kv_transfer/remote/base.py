"""The cluster KV store's contract: blocks every worker can read, named by content.

A store holds immutable values under ``BlockName`` keys (``names.py``). It is shared by
the whole cluster and trusted by none of it blindly: every value carries a checksum
(``codec.py``) and a value that fails it is a miss, never data.

Ownership: ``put_blocks`` copies the caller's bytes before it returns (the caller may
reuse its buffers at once); the views ``get_blocks`` returns belong to the caller (the
store keeps no reference). The store owns its connections; ``close()`` ends them.

Every call has a deadline: ``StoreOptions.timeout_s`` bounds connecting and each wait
for the server's bytes (a socket timeout, no retries), so a stopped, partitioned or
dead server makes a call fail within about ``timeout_s``, never hang. What each failure
means:

- ``StoreError``: the call did not complete (unreachable, timed out, refused, a
  shard moving); nothing can be concluded about the keys. The caller treats it as a
  miss (load) or a skipped write (save); the next call may succeed.
- ``StoreTimeoutError`` (a ``StoreError``): the same, because the deadline passed.
- A corrupt value (bad header, length or checksum) is not an error: the block reads as
  missing and ``stats()["bad_blocks"]`` counts it. The store deletes it (only if it is
  still that value: a good one published meanwhile stays), so the next writer can publish
  the block again instead of the bad value blocking ``SET NX`` until its TTL;
  ``stats()["bad_deleted"]`` counts deletions. ``discard`` does the same for a value the
  caller found bad past the checksum (its encoding).

Immutability: ``put_blocks`` writes a key only if it is absent (SET NX), in one
atomic command per block, so a reader sees either no value or the whole first one, and
two writers of one block cannot interleave. A value lives ``ttl_s`` seconds at most;
the server's memory cap (``maxmemory`` with an eviction policy, set by whoever runs it:
``local_redis.py`` does) may drop it sooner. A prefix whose middle block was dropped
reads only up to the hole: ``lookup_prefix`` counts the contiguous run.

TLS: ``rediss://`` and ``rediss-cluster://`` reach the store over TLS (TLS 1.2 at least),
verifying its certificate and name against ``StoreOptions.tls.ca`` (the system's roots
without one) and presenting ``tls.cert``/``tls.key`` as the client certificate when given
(a server with ``tls-auth-clients yes`` requires one). A handshake that fails (no client
certificate, a CA that did not sign the server's, a wrong name) is a ``StoreError``, as an
unreachable server is. ``--require-tls`` refuses the plaintext schemes
(``check_store_tls``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.remote.names import BlockName


class StoreError(Exception):
    """A store call did not complete; the message names the server and the cause."""


class StoreTimeoutError(StoreError):
    """A store call passed its deadline (``StoreOptions.timeout_s``)."""


@dataclass(frozen=True)
class StoreOptions:
    timeout_s: float = 1.0  # connect, and each wait for the server's reply
    password: str | None = field(default=None, repr=False)  # AUTH; never in a URL or log
    # the TLS schemes' files: the CA the store's certificate is checked against (None:
    # the system's roots) and the client certificate; a plaintext URL ignores them
    tls: TlsFiles = TlsFiles()

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, not {self.timeout_s}")


class KVStore(Protocol):
    def lookup_prefix(self, names: Sequence[BlockName]) -> int:
        """How many of ``names`` (one prompt's blocks, in order) are held from the first
        on, stopping at the first missing one; one round trip. ``StoreError``."""
        ...

    def get_blocks(self, names: Sequence[BlockName]) -> list[memoryview | None]:
        """Each block's payload, or None where missing or corrupt (counted); one round
        trip. ``StoreError``."""
        ...

    def put_blocks(self, items: Sequence[tuple[BlockName, bytes | memoryview]],
                   ttl_s: float) -> int:
        """Publish blocks not yet held, each for ``ttl_s`` seconds; a held one keeps its
        first value. Returns how many were written; one round trip. ``StoreError``."""
        ...

    def discard(self, items: Sequence[tuple[BlockName, memoryview]]) -> int:
        """Delete each block whose payload (as ``get_blocks`` returned it) the caller
        found bad, only if the store still holds that value; how many were deleted; one
        round trip. ``StoreError``."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters since start: calls, blocks, hits, misses, bad_blocks, bad_deleted,
        errors, ..."""
        ...

    def close(self) -> None:
        """End the connections; the store is not used after."""
        ...


# URL scheme -> "module:factory", imported only when one is created (the redis package)
_BUILTIN = {"redis": ".redis_store:open_redis", "redis-cluster": ".redis_store:open_redis",
            "rediss": ".redis_store:open_redis", "rediss-cluster": ".redis_store:open_redis"}
TLS_SCHEMES = ("rediss", "rediss-cluster")


def store_schemes() -> list[str]:
    """Every store's URL scheme; imports no store module."""
    return sorted(_BUILTIN)


def check_store_url(url: str, flag: str = "--kv-store") -> None:
    """A store URL every worker may be handed: a known scheme, no password (vLLM logs
    its config, and a command line shows it), and no query or fragment: the client would
    take its options from a query over ours (``?ssl_cert_reqs=none`` turns certificate
    checks off, ``?password=`` carries a password past the check above)."""
    parts = urlsplit(url)
    if parts.scheme not in store_schemes():
        raise ValueError(f"{flag} {url!r}: unknown scheme {parts.scheme!r}; valid schemes: "
                         + ", ".join(f"{s}://" for s in store_schemes()))
    if parts.password is not None:
        raise ValueError(f"{flag}: no password in the URL (every worker's command line and "
                         "vLLM's log would show it): --kv-store-password-file")
    if parts.query or parts.fragment:
        raise ValueError(f"{flag} {url!r}: no query or fragment in the URL (its options "
                         "would override the store's TLS and password settings): "
                         "HOST:PORT[/DB] only")


def check_store_tls(url: str, required: bool) -> None:
    """``--require-tls`` refuses a store URL whose bytes (KV blocks, the password) would
    cross the network in clear."""
    if required and urlsplit(url).scheme not in TLS_SCHEMES:
        raise ValueError(f"--require-tls refuses the plaintext KV store {url!r}: give "
                         "rediss://HOST:PORT or rediss-cluster://HOST:PORT[,...] (a Redis "
                         "serving TLS)")


def create_store(url: str, options: StoreOptions | None = None) -> KVStore:
    """The store ``url`` names (``redis://HOST:PORT[/DB]``,
    ``redis-cluster://HOST:PORT[,HOST:PORT...]``, over TLS ``rediss://`` and
    ``rediss-cluster://``); an unknown scheme lists the valid
    ones (``ValueError``). Connecting may raise ``StoreError``."""
    scheme = urlsplit(url).scheme
    target = _BUILTIN.get(scheme)
    if target is None:
        raise ValueError(f"unknown KV store URL scheme {scheme!r} in {url!r}; valid "
                         f"schemes: {', '.join(f'{s}://' for s in store_schemes())}")
    module, _, name = target.partition(":")
    build: Callable[[str, StoreOptions], KVStore] = getattr(
        importlib.import_module(module, __package__), name)
    return build(url, options or StoreOptions())
