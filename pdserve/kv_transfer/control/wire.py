"""Control messages on a KV connection: a 4-byte big-endian length, then JSON.

Only control travels as JSON (hello, pull, release, status and their replies);
tensor bytes never do: they go raw, straight from and into the KV tensors.
"""

from __future__ import annotations

import json
import select
import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Any

# 2: every pull ends with a trailer message (bytes, optional checksum).
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 16 << 20
SOCK_BUF = 4 << 20
_LEN = struct.Struct("!I")


class TransferError(RuntimeError):
    """A transfer or control exchange failed (peer gone, refused, deadline)."""


class IncompatiblePeerError(TransferError):
    """The handshake found that the peers' KV caches are not interchangeable."""


class BadMessageError(TransferError):
    """A control message this end cannot act on: too large, not a JSON object, or a
    field missing, of the wrong type or out of range. A server answers it with
    ``{"ok": false, "error": ...}`` and closes the connection (what follows on it,
    a push's payload say, cannot be framed)."""


def set_deadline(sock: socket.socket, deadline: float, stall_s: float | None = None) -> None:
    """Bound the next socket operation by an absolute ``time.monotonic`` deadline, and
    each receive by ``stall_s`` (None: the deadline only): a peer that sends no byte
    for that long fails the transfer then, not at its deadline. (Never for a send:
    ``sendall``'s timeout bounds the whole call, which a thin link may make long.)"""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TransferError("deadline exceeded")
    sock.settimeout(remaining if stall_s is None else min(remaining, stall_s))


def send_msg(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg, separators=(",", ":")).encode()
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE_BYTES) -> dict[str, Any] | None:
    """Read one message of at most ``max_bytes``; None on a clean EOF before its first byte."""
    head = recv_exact(sock, _LEN.size, eof_ok=True)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > max_bytes:
        raise BadMessageError(f"control message of {size} bytes exceeds {max_bytes}")
    body = recv_exact(sock, size)
    assert body is not None
    try:
        msg = json.loads(body)
    except (ValueError, RecursionError) as exc:  # not UTF-8, not JSON, nested too deep
        raise BadMessageError(f"control message is not JSON ({type(exc).__name__})") from None
    if not isinstance(msg, dict):
        raise BadMessageError("control message is not a JSON object")
    return msg


def recv_exact(sock: socket.socket, size: int, eof_ok: bool = False) -> bytes | None:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            if eof_ok and got == 0:
                return None
            raise TransferError(f"peer closed the connection after {got} of {size} bytes")
        got += n
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    size = len(view)
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise TransferError(f"peer closed the connection after {got} of {size} bytes")
        got += n


def check_reply(reply: dict[str, Any] | None, what: str) -> dict[str, Any]:
    if reply is None:
        raise TransferError(f"peer closed the connection during {what}")
    if not reply.get("ok"):
        err = str(reply.get("error", "unknown error"))
        if reply.get("incompatible"):
            raise IncompatiblePeerError(err)
        raise TransferError(f"{what} refused: {err}")
    return reply


def compare_compat(local: dict[str, Any], remote: dict[str, Any], local_name: str = "local",
                   remote_name: str = "remote") -> str | None:
    """A message naming every differing key with both sides' values, or None."""
    diffs = [
        f"{key}: {local_name}={local.get(key)!r} {remote_name}={remote.get(key)!r}"
        for key in sorted(set(local) | set(remote))
        if local.get(key) != remote.get(key)
    ]
    return "incompatible KV peers (" + "; ".join(diffs) + ")" if diffs else None


def wait_done(done: Callable[[], bool], deadline: float, what: str,
              conn: socket.socket | None = None) -> None:
    """Poll ``done`` with a backoff capped at 1 ms until it holds or ``deadline``.

    With ``conn`` (a control connection the peer sends nothing on meanwhile),
    its EOF ends the wait at once: a killed peer is noticed without a timeout.
    """
    delay = 1e-4
    while not done():
        if time.monotonic() >= deadline:
            raise TransferError(f"{what} exceeded its deadline")
        if conn is not None and peer_closed(conn):
            raise TransferError(f"{what}: the peer closed its control connection")
        time.sleep(delay)
        delay = min(delay * 2, 1e-3)


def peer_closed(conn: socket.socket) -> bool:
    """True once the peer has closed (or reset) ``conn``; never blocks. Under TLS
    (which cannot peek) any record counts: the peer sends nothing meanwhile but
    its close_notify."""
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        if readable and isinstance(conn, ssl.SSLSocket):
            return True
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def linger(conn: socket.socket, timeout_s: float = 1.0, max_bytes: int = 1 << 20) -> None:
    """Before closing ``conn`` on a peer whose bytes were not all read (a refused
    message, a push payload after it): end our side, then read and drop what the peer
    still sends, until its EOF, ``max_bytes`` or ``timeout_s``. Closed with unread
    bytes, the kernel would reset the connection, and the peer could lose the error
    answered just before."""
    deadline = time.monotonic() + timeout_s
    try:
        conn.shutdown(socket.SHUT_WR)
        while max_bytes > 0 and (remaining := deadline - time.monotonic()) > 0:
            conn.settimeout(remaining)
            chunk = conn.recv(min(max_bytes, 1 << 16))
            if not chunk:
                return
            max_bytes -= len(chunk)
    except (OSError, ValueError):
        return


def tune(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCK_BUF)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCK_BUF)
