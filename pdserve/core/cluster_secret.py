"""The shared cluster secret: one file, read once per process, that every member
of a cluster holds (docs/security.md, "Cluster secret").

Only proofs derived from it travel: signed, single-use proofs both ways on router↔worker
gRPC calls (``pdserve.core.grpc_proofs``, ``grpc_auth``), MACs on membership entries, and a
mutual challenge-response on every KV connection
(``pdserve.kv_transfer.control.auth``). The secret itself never goes on a command line,
into vLLM's config (which vLLM logs) or into a ``repr``: processes pass the
file's path.

Refusals are counted here, in one place, for both planes (``grpc``, ``kv``), and
logged at most once per ``_LOG_EVERY_S`` per plane and reason, so a scanner
cannot flood the log.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("pdserve.auth")

MIN_SECRET_BYTES = 16
_LOG_EVERY_S = 10.0

AUTH_REFUSALS = Counter(
    "pdserve_cluster_auth_refusals", "Connections or calls refused by cluster authentication",
    ["plane", "reason"])


class ClusterSecret:
    """The secret's bytes, kept out of ``repr``/``str`` and compared in constant time."""

    def __init__(self, key: bytes, source: str = "<memory>") -> None:
        if len(key) < MIN_SECRET_BYTES:
            raise ValueError(f"cluster secret {source} holds {len(key)} bytes; it needs at "
                             f"least {MIN_SECRET_BYTES} (e.g. `head -c 32 /dev/urandom | "
                             f"base64 > FILE`)")
        self._key = key
        self.source = source

    def __repr__(self) -> str:
        return f"ClusterSecret(source={self.source!r})"

    def mac(self, *parts: bytes) -> bytes:
        """HMAC-SHA256 over ``parts`` joined by NUL bytes (a label first, by convention)."""
        return hmac.new(self._key, b"\0".join(parts), hashlib.sha256).digest()


@functools.lru_cache(maxsize=8)
def load_cluster_secret(path: str) -> ClusterSecret:
    """The secret in ``path`` (surrounding whitespace stripped), read once per process.
    ``ValueError`` in one line for a missing, unreadable, empty or too short file."""
    try:
        key = Path(path).read_bytes().strip()
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"cannot read the cluster secret file {path}: "
                         f"{exc.strerror or exc}") from None
    secret = ClusterSecret(key, source=path)  # a short one fails before any warning
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        logger.warning("cluster secret file %s is readable by others (mode %o); chmod 600 it",
                       path, stat.S_IMODE(mode))
    return secret


def optional_secret(path: str | None) -> ClusterSecret | None:
    """``load_cluster_secret(path)``, or None (an unauthenticated cluster) without a path."""
    return load_cluster_secret(path) if path else None


def write_cluster_secret(path: Path) -> Path:
    """A fresh random secret in a new file only its owner can read (``pdserve up``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_urlsafe(32) + "\n")
    return path


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_if_open(what: str, host: str, secret: ClusterSecret | None,
                 mutual_tls: bool = False) -> None:
    """Say so when a listener reachable from other machines takes anyone."""
    if secret is None and not mutual_tls and not is_loopback(host):
        logger.warning("%s on %s is UNAUTHENTICATED: any host that reaches it is trusted "
                       "(give every process --cluster-secret-file)", what, host)


class _Refusals:
    """Counts every refusal; logs one line per (plane, reason) at most every ``_LOG_EVERY_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._logged: dict[tuple[str, str], tuple[float, int]] = {}

    def note(self, plane: str, reason: str, peer: str) -> None:
        AUTH_REFUSALS.labels(plane=plane, reason=reason).inc()
        now = time.monotonic()
        key = (plane, reason)
        with self._lock:
            last, suppressed = self._logged.get(key, (-_LOG_EVERY_S, 0))
            if now - last < _LOG_EVERY_S:
                self._logged[key] = (last, suppressed + 1)
                return
            self._logged[key] = (now, 0)
        more = f" ({suppressed} more since the last report)" if suppressed else ""
        logger.warning("refused %s peer %s: %s%s", plane, peer, reason, more)


_REFUSALS = _Refusals()


def note_refusal(plane: str, reason: str, peer: str) -> None:
    """Count (``pdserve_cluster_auth_refusals_total{plane,reason}``) and log a refusal."""
    _REFUSALS.note(plane, reason, peer)


class _RefusalsCollector(Collector):
    """``AUTH_REFUSALS`` (kept in the process's default registry) for another registry."""

    def collect(self) -> Iterator[Metric]:
        yield from AUTH_REFUSALS.collect()


def export_refusals(registry: CollectorRegistry) -> None:
    """Show this process's refusals on ``registry`` too (the router's ``/metrics`` has a
    registry of its own; workers export the default one)."""
    registry.register(_RefusalsCollector())


def num_refusals(plane: str, reason: str | None = None) -> int:
    """This process's refusals on ``plane`` (of ``reason``, or all of them)."""
    total = 0.0
    for metric in AUTH_REFUSALS.collect():
        for sample in metric.samples:
            labels = sample.labels
            if (sample.name.endswith("_total") and labels.get("plane") == plane
                    and reason in (None, labels.get("reason"))):
                total += sample.value
    return int(total)
