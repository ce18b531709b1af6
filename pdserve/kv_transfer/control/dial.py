"""Opening a control connection to a KV peer, and one-off exchanges on a fresh one.

Every client connection starts the same way, pooled (``pool.py``) or one-off
(``request_once``): TCP, mutual TLS when the cluster has it (``tls.py``), then the
cluster secret's challenge when it has one (``auth.py``). Only then do messages flow.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control.auth import authenticate_to_server
from pdserve.kv_transfer.control.tls import KvTls, TlsHandshakeError
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.control.wire import tune as tune_socket


def dial(peer: PeerAddress, deadline: float, secret: ClusterSecret | None = None,
         tls: KvTls | None = None, tune: bool = True, stall_s: float | None = None
         ) -> socket.socket:
    """A connection to ``peer``'s control port, encrypted with ``tls`` and authenticated
    with ``secret``, by ``deadline``. ``TransferError`` if it cannot be reached,
    ``TlsHandshakeError`` (naming the peer) if a certificate does not hold,
    ``AuthError`` if the secret does not; the connection is closed on every failure.
    ``stall_s`` bounds the connect too (a peer cut off answers no SYN)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError(f"deadline exceeded before connecting to {peer}")
    try:
        conn = socket.create_connection(
            (peer.host, peer.port), timeout=remaining if stall_s is None else min(remaining,
                                                                                  stall_s))
    except OSError as exc:
        raise TransferError(f"cannot reach KV peer {peer}: {exc}") from exc
    try:
        if tune:
            tune_socket(conn)
        if tls is not None:
            conn = tls.connect(conn, peer.host, deadline)  # closes it on failure
        if secret is not None:
            authenticate_to_server(conn, secret, deadline, str(peer))
    except TlsHandshakeError as exc:
        raise TlsHandshakeError(f"KV peer {peer}: {exc}") from None
    except OSError as exc:
        conn.close()
        raise TransferError(f"connecting to KV peer {peer} failed: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


def request_once(host: str, port: int, msg: dict[str, Any], timeout_s: float,
                 secret: ClusterSecret | None = None, tls: KvTls | None = None
                 ) -> dict[str, Any]:
    """One control exchange on a fresh connection (release, status): over mutual TLS
    with ``tls``, authenticated first when the cluster has a ``secret``."""
    deadline = time.monotonic() + timeout_s
    try:
        with dial(PeerAddress(host, port), deadline, secret, tls, tune=False) as sock:
            set_deadline(sock, deadline)
            send_msg(sock, msg)
            return check_reply(recv_msg(sock), str(msg.get("op")))
    except OSError as exc:
        raise TransferError(f"KV endpoint {host}:{port} unreachable: {exc}") from exc
