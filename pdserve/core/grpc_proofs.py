"""The proofs router→worker gRPC calls carry, and those workers answer with: pure
functions of the cluster secret (no grpc here; ``grpc_auth`` puts them on calls).

The router's proof, one per call (the header ``x-pdserve-cluster-auth``)::

    v2.<unix_ms>.<nonce>.<HMAC(k, "pdserve-grpc-v2-router", audience, method, unix_ms, nonce)>

``audience`` is the worker's id, ``method`` the full gRPC method name, ``nonce`` 16
fresh random bytes (hex). A worker accepts it only if the audience is itself, ``unix_ms``
is within ``WINDOW_S`` of its clock, the nonce was not seen in the window
(``NonceCache``) and the MAC matches (constant time). So a captured header fails when
replayed (its nonce is spent), sent to another worker (its audience), for another method,
or later (the window; a nonce is remembered for as long as its header could pass).

The worker's proof, in the initial metadata of every authenticated answer
(``x-pdserve-worker-proof``): ``HMAC(k, "pdserve-grpc-v2-worker", worker id, method,
router nonce)``. The router checks it before it trusts the answer (and, on a
``Session``, before it sends any prompt). It binds the router's fresh nonce, so a
recorded answer proves nothing on a later call; the two labels keep one side's MAC
from being reflected as the other's.
"""

from __future__ import annotations

import collections
import hmac
import os
import threading
import time

from pdserve.core.cluster_secret import ClusterSecret

AUTH_HEADER = "x-pdserve-cluster-auth"
PROOF_HEADER = "x-pdserve-worker-proof"
AUDIENCE_HEADER = "x-pdserve-audience"  # a refusal names the worker's id (not secret)
VERSION = "v2"
WINDOW_S = 30.0
NONCE_BYTES = 16
MAX_NONCES = 200_000  # a bounded memory: past it, calls are refused, never a replay let in
_ROUTER = b"pdserve-grpc-v2-router"
_WORKER = b"pdserve-grpc-v2-worker"


def sign_call(secret: ClusterSecret, audience: str, method: str,
              now_ms: int | None = None) -> tuple[str, str]:
    """(header value, its nonce) for one call of ``method`` to the worker ``audience``."""
    ts = str(int(time.time() * 1000) if now_ms is None else now_ms)
    nonce = os.urandom(NONCE_BYTES).hex()
    mac = secret.mac(_ROUTER, audience.encode(), method.encode(), ts.encode(),
                     nonce.encode()).hex()
    return f"{VERSION}.{ts}.{nonce}.{mac}", nonce


def worker_proof(secret: ClusterSecret, worker_id: str, method: str, nonce: str) -> str:
    return secret.mac(_WORKER, worker_id.encode(), method.encode(), nonce.encode()).hex()


def check_worker_proof(secret: ClusterSecret, worker_id: str, method: str, nonce: str,
                       proof: str | bytes | None) -> bool:
    if proof is None:
        return False
    given = proof.encode() if isinstance(proof, str) else proof
    want = worker_proof(secret, worker_id, method, nonce).encode()
    return hmac.compare_digest(given, want)


class NonceCache:
    """The nonces accepted within the window, bounded (``MAX_NONCES``). A nonce is kept
    ``2 * WINDOW_S`` after it arrived: its header's time may lie up to ``WINDOW_S`` in
    the future, so it could pass until then. Thread-safe."""

    def __init__(self, window_s: float = WINDOW_S, capacity: int = MAX_NONCES) -> None:
        self._keep_s = 2 * window_s
        self._capacity = capacity
        self._seen: collections.OrderedDict[str, float] = collections.OrderedDict()
        self._lock = threading.Lock()

    def add(self, nonce: str) -> str | None:
        """None if ``nonce`` is fresh (now spent); else why it is refused."""
        now = time.monotonic()
        with self._lock:
            seen = self._seen
            while seen:
                first, arrived = next(iter(seen.items()))
                if now - arrived <= self._keep_s:
                    break
                del seen[first]
            if nonce in seen:
                return "replayed nonce"
            if len(seen) >= self._capacity:
                return "nonce cache full"
            seen[nonce] = now
            return None


class CallVerifier:
    """A worker's check of the router's header (``check``), and its answer (``proof``)."""

    def __init__(self, secret: ClusterSecret, worker_id: str,
                 window_s: float = WINDOW_S, nonces: NonceCache | None = None) -> None:
        self._secret = secret
        self.worker_id = worker_id
        self._window_ms = int(window_s * 1000)
        self._nonces = nonces or NonceCache(window_s)

    def check(self, header: str | bytes | None, method: str) -> tuple[str | None, str]:
        """(None, nonce) for a good header; else (the reason, "")."""
        if header is None:
            return "no token", ""
        text = header.decode(errors="replace") if isinstance(header, bytes) else header
        parts = text.split(".")
        if (len(parts) != 4 or parts[0] != VERSION or not parts[1].isascii()
                or not parts[1].isdigit()
                or len(parts[1]) > 16):  # (int() refuses 4,300+ digits: never let it raise)
            return "malformed token", ""
        _, ts, nonce, mac = parts
        if len(nonce) != 2 * NONCE_BYTES:
            return "malformed token", ""
        if abs(int(time.time() * 1000) - int(ts)) > self._window_ms:
            return "stale token", ""
        if hmac.compare_digest(mac.encode(), self._mac(self.worker_id, method, ts, nonce)):
            refused = self._nonces.add(nonce)
            return (None, nonce) if refused is None else (refused, "")
        if hmac.compare_digest(mac.encode(), self._mac("", method, ts, nonce)):
            return "audience unknown", ""  # a router asking whom it talks to
        return "wrong token", ""  # another secret, or signed for another worker

    def proof(self, method: str, nonce: str) -> str:
        return worker_proof(self._secret, self.worker_id, method, nonce)

    def _mac(self, audience: str, method: str, ts: str, nonce: str) -> bytes:
        return self._secret.mac(_ROUTER, audience.encode(), method.encode(), ts.encode(),
                                nonce.encode()).hex().encode()
