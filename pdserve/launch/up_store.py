"""``pdserve up``'s cluster KV store: the ``--kv-store*`` and ``--kv-compression`` flags
handed to every vLLM worker, or a local redis-server (``--with-redis``) that ``up``
starts for them, as it starts etcd for ``--with-etcd``.

The local server is a cache bound to 127.0.0.1: a memory cap (``--redis-maxmemory``)
enforced by the server, ``allkeys-lru`` eviction (every block is written with a TTL, so
``volatile-*`` would pick from the same keys; ``volatile-ttl`` would evict the soonest to
expire, which with write-once blocks is the oldest written: a shared system prompt's
blocks, the hottest, would go first), and a password (``requirepass``) that ``up``
generates into a file of its own unless ``--kv-store-password-file`` names one. Its log
is ``redis.log`` in the run's log folder. When ``up`` has mutual TLS files (as for its
etcd) the server speaks TLS only, with the cluster's certificate, requiring client
certificates its CA signed, and the workers get its ``rediss://`` URL.
"""

from __future__ import annotations

import re
import secrets
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.config import KV_COMPRESSIONS
from pdserve.kv_transfer.remote.base import check_store_url
from pdserve.kv_transfer.tiers.policies.registry import ADMIT_ALL, check_admission

if TYPE_CHECKING:  # the redis package loads only when a store is used
    from pdserve.kv_transfer.remote.local_redis import LocalRedis

__all__ = ["LOCAL_POLICY", "KvStoreUp", "LocalStore", "check_maxmemory"]

LOCAL_POLICY = "allkeys-lru"
DEFAULT_REDIS_MAXMEMORY = "1gb"
_MAXMEMORY = re.compile(r"[1-9][0-9]*(?:[kmg]b?|b)?", re.IGNORECASE)


def check_maxmemory(text: str) -> str:
    """A redis ``maxmemory`` size: bytes, or with k/kb/m/mb/g/gb (not 0: no cap)."""
    if not _MAXMEMORY.fullmatch(text.strip()):
        raise ValueError("expected a memory size such as 512mb or 2gb (not 0)")
    return text.strip().lower()


@dataclass(frozen=True)
class KvStoreUp:
    url: str | None = None  # --kv-store; None: no store (unless with_redis)
    ttl_s: float = 3600.0
    timeout_s: float = 0.5
    password_file: str | None = None
    # --kv-store-tls-*: a rediss:// store's files where not the cluster's --tls-*
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    compression: str = "none"
    admission: str = ADMIT_ALL  # --kv-store-admission
    with_redis: bool = False  # start a local redis-server and point every worker at it
    redis_maxmemory: str = DEFAULT_REDIS_MAXMEMORY

    def __post_init__(self) -> None:
        if self.url and self.with_redis:
            raise ValueError("give --kv-store URL or --with-redis, not both")
        if self.ttl_s <= 0 or self.timeout_s <= 0:
            raise ValueError("--kv-store-ttl-s and --kv-store-timeout-s must be > 0")
        if self.compression not in KV_COMPRESSIONS:
            raise ValueError(f"--kv-compression must be one of {', '.join(KV_COMPRESSIONS)}")
        check_maxmemory(self.redis_maxmemory)
        check_admission(self.admission)
        if self.url:
            check_store_url(self.url)
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--kv-store-tls-cert and --kv-store-tls-key go together")
        if (self.tls_ca or self.tls_cert) and not self.url:
            raise ValueError("--kv-store-tls-ca/-cert/-key need a --kv-store URL (--with-redis "
                             "serves with the cluster's --tls-cert/--tls-key/--tls-ca)")
        if self.password_file:
            if not self.enabled:
                raise ValueError("--kv-store-password-file needs --kv-store URL or "
                                 "--with-redis")
            from pdserve.kv_transfer.remote.local_redis import read_password

            read_password(Path(self.password_file))  # a bad file fails before any child

    @property
    def enabled(self) -> bool:
        return bool(self.url) or self.with_redis

    def flags(self) -> list[str]:
        """Every vLLM worker's store flags (none without a store URL); the password's
        file, never the password."""
        argv = ([] if self.compression == "none" else ["--kv-compression", self.compression])
        if not self.url:
            return argv
        argv = ["--kv-store", self.url, "--kv-store-ttl-s", repr(self.ttl_s),
                "--kv-store-timeout-s", repr(self.timeout_s), *argv]
        if self.admission != ADMIT_ALL:
            argv += ["--kv-store-admission", self.admission]
        if self.password_file:
            argv += ["--kv-store-password-file", self.password_file]
        for flag, path in (("--kv-store-tls-ca", self.tls_ca),
                           ("--kv-store-tls-cert", self.tls_cert),
                           ("--kv-store-tls-key", self.tls_key)):
            argv += [flag, path] if path else []
        return argv


class LocalStore:
    """``--with-redis``: a local redis-server with a password (and TLS with ``tls``: the
    cluster's mutual TLS files), and the store settings that point the workers at it.
    ``stop()`` ends it and removes its files."""

    def __init__(self, store: KvStoreUp, log_dir: Path, tls: TlsFiles | None = None
                 ) -> None:
        from pdserve.kv_transfer.remote.local_redis import LocalRedis

        self._own: tempfile.TemporaryDirectory[str] | None = None
        password_file = store.password_file
        if not password_file:
            self._own = tempfile.TemporaryDirectory(prefix="pdserve-up-redis-")
            path = Path(self._own.name) / "kv-store-password"
            path.touch(mode=0o600)
            path.write_text(secrets.token_hex(24) + "\n")
            password_file = str(path)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.server: LocalRedis = LocalRedis(
                maxmemory=store.redis_maxmemory, policy=LOCAL_POLICY,
                log_path=log_dir / "redis.log", password_file=Path(password_file), tls=tls)
        except (RuntimeError, ValueError):
            self._cleanup()
            raise
        self.store = replace(store, url=self.server.url, with_redis=False,
                             password_file=password_file)

    def start(self) -> LocalStore:
        try:
            self.server.start()
        except Exception:
            self._cleanup()
            raise
        return self

    def stop(self) -> None:
        self.server.stop()
        self._cleanup()

    def _cleanup(self) -> None:
        if self._own is not None:
            self._own.cleanup()
            self._own = None
