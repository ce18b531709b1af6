"""Client-side control connections to KV peers, handshaken once and reused."""

from __future__ import annotations

import select
import socket
import ssl
import threading
import time
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control.dial import dial
from pdserve.kv_transfer.control.tls import KvTls
from pdserve.kv_transfer.control.wire import (
    IncompatiblePeerError,
    TransferError,
    check_reply,
    recv_msg,
    send_msg,
    set_deadline,
)


class ConnectionPool:
    """Idle connections per peer; one is reused for at most ``max_idle_s`` of idleness
    (the server drops idle ones later than that) and only while the peer has not closed
    it (a restarted peer on the same address). A connection that failed is closed by its
    user, never checked back in."""

    def __init__(self, max_idle_s: float, secret: ClusterSecret | None = None,
                 tls: KvTls | None = None, stall_s: float | None = None) -> None:
        self._max_idle_s = max_idle_s
        self._stall_s = stall_s  # a new connection's connect and handshake replies
        self._secret = secret  # with it, a new connection authenticates before its hello
        self._tls = tls  # with it, every connection is mutual TLS first
        self._idle: dict[PeerAddress, list[tuple[socket.socket, float]]] = {}
        self._lock = threading.Lock()

    def checkout(self, peer: PeerAddress, deadline: float,
                 compat: dict[str, Any]) -> socket.socket:
        """A handshaken (and, with a secret, authenticated; with TLS, encrypted)
        connection to ``peer``; ``IncompatiblePeerError`` names both sides, ``AuthError``
        a peer that does not prove this cluster's secret or refuses ours,
        ``TlsHandshakeError`` one whose certificate (or ours) does not hold."""
        with self._lock:
            idle = self._idle.get(peer, [])
            while idle:
                conn, last_used = idle.pop()
                if time.monotonic() - last_used < self._max_idle_s and not dropped(conn):
                    return conn
                conn.close()  # the peer may have dropped it already
        conn = dial(peer, deadline, self._secret, self._tls, stall_s=self._stall_s)
        try:
            set_deadline(conn, deadline, self._stall_s)
            send_msg(conn, {"op": "hello", "compat": compat})
            check_reply(recv_msg(conn), f"handshake with {peer}")
        except IncompatiblePeerError as exc:
            conn.close()
            raise IncompatiblePeerError(f"KV peer {peer} refused the handshake: {exc}") from None
        except (OSError, TransferError) as exc:
            conn.close()
            raise TransferError(f"handshake with KV peer {peer} failed: {exc}") from exc
        return conn

    def checkin(self, peer: PeerAddress, conn: socket.socket) -> None:
        with self._lock:
            self._idle.setdefault(peer, []).append((conn, time.monotonic()))

    def close(self) -> None:
        with self._lock:
            for conns in self._idle.values():
                for conn, _ in conns:
                    conn.close()
            self._idle.clear()


def dropped(conn: socket.socket) -> bool:
    """The peer closed (or reset) this idle connection, so it cannot be reused. An idle
    control connection has nothing to read: EOF, an error or stray bytes all mean dead
    (under TLS, any record: a close_notify, or data that was never asked for)."""
    if isinstance(conn, ssl.SSLSocket):
        try:
            return conn.pending() > 0 or bool(select.select([conn], [], [], 0)[0])
        except (OSError, ValueError):
            return True
    timeout = conn.gettimeout()
    conn.setblocking(False)
    try:
        conn.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return False  # nothing to read: alive
    except OSError:
        return True
    finally:
        conn.settimeout(timeout)
    return True
