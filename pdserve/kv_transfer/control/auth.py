"""Cluster authentication on a KV control connection, before anything else on it.

Every transport's KV moves only after a control-channel exchange (``channel.py``),
so authenticating that channel gates every transport: tcp's bytes travel on it,
ucx's endpoints and torch's process groups are negotiated on it. With a cluster
secret, a connection's first messages are a mutual challenge-response::

    client -> {"op": "auth", "v": 1}
    server -> {"ok": true, "nonce": sn}                        (16 random bytes, hex)
    client -> {"op": "auth_proof", "nonce": cn, "mac": HMAC(k, "client", sn, cn)}
    server -> {"ok": true, "mac": HMAC(k, "server", sn, cn)}   | {"ok": false} and close

The role labels keep one side's proof from being replayed as the other's; fresh
nonces on both sides keep an old exchange from being replayed at all. The client
speaks first so that a misconfigured pair fails at once with a clear reason
(a server without the secret answers "unknown op", one with it refuses a
``hello``) instead of both sides waiting for a deadline.

This authenticates peers; it does not encrypt: KV bytes still cross the network
in the clear.
"""

from __future__ import annotations

import hmac
import os
import socket
import time
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret, note_refusal
from pdserve.kv_transfer.control.wire import TransferError, recv_msg, send_msg, set_deadline

VERSION = 1
NONCE_BYTES = 16
# An unauthenticated peer gets this long, and messages this small, to prove itself.
AUTH_TIMEOUT_S = 5.0
MAX_AUTH_MESSAGE_BYTES = 1024
_LABEL = b"pdserve-kv-v1"


class AuthError(TransferError):
    """A peer failed cluster authentication (or we could not authenticate to it)."""


def _mac(secret: ClusterSecret, role: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return secret.mac(_LABEL, role, server_nonce, client_nonce)


def authenticate_to_server(conn: socket.socket, secret: ClusterSecret, deadline: float,
                           peer: str) -> None:
    """Client side; raises ``AuthError`` unless the server proved the same secret."""
    deadline = min(deadline, time.monotonic() + AUTH_TIMEOUT_S)
    set_deadline(conn, deadline)
    send_msg(conn, {"op": "auth", "v": VERSION})
    challenge = _reply(recv_msg(conn, MAX_AUTH_MESSAGE_BYTES), peer)
    set_deadline(conn, deadline)
    server_nonce = _nonce(challenge)
    if server_nonce is None:
        raise AuthError(f"KV peer {peer} sent a malformed authentication challenge")
    client_nonce = os.urandom(NONCE_BYTES)
    send_msg(conn, {"op": "auth_proof", "nonce": client_nonce.hex(),
                    "mac": _mac(secret, b"client", server_nonce, client_nonce).hex()})
    set_deadline(conn, deadline)
    proof = _reply(recv_msg(conn, MAX_AUTH_MESSAGE_BYTES), peer)
    want = _mac(secret, b"server", server_nonce, client_nonce)
    if not hmac.compare_digest(_hex(proof.get("mac")), want):
        note_refusal("kv", "server proof wrong", peer)
        raise AuthError(f"KV peer {peer} does not hold this cluster's secret")


def authenticate_client(conn: socket.socket, secret: ClusterSecret, peer: str,
                        timeout_s: float = AUTH_TIMEOUT_S) -> bool:
    """Server side, on a fresh connection: whether the client proved the secret.
    A refusal is answered (so the client can say why), counted and logged; the
    caller then closes the connection without serving anything on it."""
    deadline = time.monotonic() + timeout_s  # bounds the whole exchange, not each read
    try:
        reason = _challenge(conn, secret, deadline)
    except (OSError, TransferError, ValueError) as exc:
        reason = f"authentication did not complete: {type(exc).__name__}"
    if reason is None:
        return True
    note_refusal("kv", reason, peer)
    try:
        send_msg(conn, {"ok": False, "error": "cluster authentication failed: this KV "
                        "endpoint needs the cluster secret (--cluster-secret-file)"})
    except OSError:
        pass
    return False


def _challenge(conn: socket.socket, secret: ClusterSecret, deadline: float) -> str | None:
    """None once the client proved the secret; else the reason it did not."""
    set_deadline(conn, deadline)
    first = recv_msg(conn, MAX_AUTH_MESSAGE_BYTES)
    if first is None:
        return "closed before authenticating"
    if first.get("op") != "auth":
        return "no credentials"
    server_nonce = os.urandom(NONCE_BYTES)
    send_msg(conn, {"ok": True, "nonce": server_nonce.hex()})
    set_deadline(conn, deadline)
    proof = recv_msg(conn, MAX_AUTH_MESSAGE_BYTES)
    if proof is None or proof.get("op") != "auth_proof":
        return "malformed proof"
    client_nonce = _nonce(proof)
    if client_nonce is None:
        return "malformed proof"
    want = _mac(secret, b"client", server_nonce, client_nonce)
    if not hmac.compare_digest(_hex(proof.get("mac")), want):
        return "wrong secret"
    send_msg(conn, {"ok": True, "mac": _mac(secret, b"server", server_nonce, client_nonce).hex()})
    return None


def _reply(msg: dict[str, Any] | None, peer: str) -> dict[str, Any]:
    if msg is None:
        raise AuthError(f"KV peer {peer} closed the connection during authentication")
    if not msg.get("ok"):
        error = str(msg.get("error", "refused"))
        if "unknown op" in error:
            error = "it has no cluster secret (unauthenticated endpoint)"
        raise AuthError(f"KV peer {peer} refused cluster authentication: {error}")
    return msg


def _nonce(msg: dict[str, Any]) -> bytes | None:
    nonce = _hex(msg.get("nonce"))
    return nonce if len(nonce) == NONCE_BYTES else None


def _hex(value: Any) -> bytes:
    try:
        return bytes.fromhex(value) if isinstance(value, str) else b""
    except ValueError:
        return b""
