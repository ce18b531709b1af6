"""The serving end of a transport's control channel: one TCP listener, a thread
per connection, messages dispatched by ``op``.

At most ``max_connections`` connections are served at once (their threads start
before a peer has authenticated, so a stranger could otherwise start any number):
one past the cap is closed at once, counted and logged as a refusal
(``note_refusal``, plane ``kv``). With a secret or TLS, at most ``max_logins`` of them
may still be logging in: one more evicts the oldest (counted, ``login evicted``), so a
stranger who opens connections and never authenticates holds no slot longer than the
next arrivals let it, and cannot starve the peers that log in within milliseconds.
The accept loop survives whatever one connection does to it (a thread that cannot
start, a socket that breaks while tuned): it ends only when the server is closed.

``hello`` (the handshake) gates the ops that touch KV: a connection may ask
``status`` or ``release`` at any time, but a ``pull`` or a transport's own op
only after its hello was accepted. What each op does is the transport's.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret, note_refusal, warn_if_open
from pdserve.kv_transfer.control.auth import AUTH_TIMEOUT_S, authenticate_client
from pdserve.kv_transfer.control.tls import KvTls, TlsHandshakeError
from pdserve.kv_transfer.control.wire import (
    BadMessageError,
    TransferError,
    linger,
    recv_msg,
    send_msg,
    tune,
)
from pdserve.kv_transfer.threads import unpin_current_thread

logger = logging.getLogger("pdserve.kv_transfer.control")

# A connection idle this long is closed by the server; clients reuse theirs for half of it.
IDLE_TIMEOUT_S = 300.0
# Connections served at once: a peer keeps a few pooled connections per concurrent pull
# (64 decode peers pulling 4 prompts each hold 256).
MAX_CONNECTIONS = 1024
# Connections still in their TLS handshake or secret challenge (a peer's takes a round trip).
MAX_LOGINS = 64
_ACCEPT_POLL_S = 1.0
# After an accept error (out of file descriptors, say), wait this long before the next.
_ACCEPT_BACKOFF_S = 0.1

Handler = Callable[[socket.socket, dict[str, Any]], None]
# Returns whether the peer's handshake was accepted.
HelloHandler = Callable[[socket.socket, dict[str, Any]], bool]


class ControlServer:
    """With ``tls``, a connection is served nothing until its TLS handshake proved a
    client certificate the CA signed (``tls.py``); with a cluster ``secret``, nothing,
    not even ``status``, until it has authenticated (``auth.py``). One that fails
    either is closed. A connection that sends nothing for ``idle_timeout_s`` (between
    messages, or inside one) is closed."""

    def __init__(self, hello: HelloHandler, open_ops: dict[str, Handler],
                 gated_ops: dict[str, Handler], stop: threading.Event,
                 secret: ClusterSecret | None = None, tls: KvTls | None = None,
                 idle_timeout_s: float = IDLE_TIMEOUT_S,
                 max_connections: int = MAX_CONNECTIONS, max_logins: int = MAX_LOGINS
                 ) -> None:
        if max_connections < 1 or max_logins < 1:
            raise ValueError(f"max_connections and max_logins must be >= 1, got "
                             f"{max_connections} and {max_logins}")
        self._hello = hello
        self._slots = threading.BoundedSemaphore(max_connections)
        self._max_logins = max_logins
        self._logins: OrderedDict[socket.socket, str] = OrderedDict()  # oldest first
        self._idle_timeout_s = idle_timeout_s
        # A fresh connection's TLS handshake and secret challenge: never longer than the
        # idle timeout lets an established connection send nothing.
        self._login_timeout_s = min(AUTH_TIMEOUT_S, idle_timeout_s)
        self._open_ops = open_ops
        self._gated_ops = gated_ops
        self._stop = stop
        self._secret = secret
        self._tls = tls
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()  # served now; shut down by close()
        self._conns_lock = threading.Lock()

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port); returns the bound port."""
        listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        warn_if_open("KV endpoint", host, self._secret, self._tls is not None)
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        threading.Thread(target=self._accept_loop, args=(listener,), name="pdserve-kv-accept",
                         daemon=True).start()
        return int(listener.getsockname()[1])

    def close(self) -> None:
        """Stop listening and end every connection being served: a closed transport
        answers nothing more, as a dead process would not (clients see EOF at once)."""
        if self._listener is not None:
            self._listener.close()
        with self._conns_lock:
            conns, self._conns = self._conns, set()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def _accept_loop(self, listener: socket.socket) -> None:
        unpin_current_thread()
        while not self._stop.is_set():
            try:
                conn, addr = listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set() or listener.fileno() == -1:
                    return  # closed
                logger.warning("KV accept failed (serving on): %s", exc)
                self._stop.wait(_ACCEPT_BACKOFF_S)
                continue
            try:
                self._admit(conn, _address(addr))
            except Exception:  # never the end of the loop: this connection only
                logger.exception("KV connection from %s not served", _address(addr))
                with contextlib.suppress(OSError):
                    conn.close()

    def _admit(self, conn: socket.socket, peer: str) -> None:
        """Serve ``conn`` on a thread of its own, or close it when ``max_connections``
        are served already. The slot taken here is given back when the thread ends,
        or at once when it could not start (``RuntimeError``: no more threads)."""
        if not self._slots.acquire(blocking=False):
            note_refusal("kv", "too many connections", peer)
            conn.close()
            return
        try:
            tune(conn)
            if self._secret is not None or self._tls is not None:
                self._start_login(conn)
            threading.Thread(target=self._serve_slot, args=(conn, peer),
                             name="pdserve-kv-conn", daemon=True).start()
        except BaseException:
            self._end_login(conn)
            self._slots.release()
            raise

    def _start_login(self, conn: socket.socket) -> None:
        """``conn`` is logging in; past ``max_logins`` the oldest login is ended."""
        with self._conns_lock:
            self._logins[conn] = ""
            evicted = (self._logins.popitem(last=False)[0]
                       if len(self._logins) > self._max_logins else None)
        if evicted is not None:
            note_refusal("kv", "login evicted", _peer_of(evicted))
            with contextlib.suppress(OSError):
                evicted.shutdown(socket.SHUT_RDWR)  # its thread ends on the closed socket

    def _end_login(self, conn: socket.socket) -> None:
        with self._conns_lock:
            self._logins.pop(conn, None)

    def _serve_slot(self, conn: socket.socket, peer: str) -> None:
        try:
            self._serve_conn(conn, peer)
        finally:
            self._end_login(conn)
            self._slots.release()

    def _serve_conn(self, conn: socket.socket, peer: str = "?") -> None:
        unpin_current_thread()
        raw = conn  # the accepted socket (the login's key), before TLS wraps it
        if self._tls is not None:
            try:  # the handshake is bounded like the secret's challenge
                conn = self._tls.accept(conn, time.monotonic() + self._login_timeout_s)
            except TlsHandshakeError as exc:
                note_refusal("kv", "tls handshake failed", peer)
                logger.debug("KV connection from %s refused: %s", peer, exc)
                return
        verified = False
        with conn, self._tracked(conn):
            if self._secret is not None and not authenticate_client(
                    conn, self._secret, peer, self._login_timeout_s):
                return
            self._end_login(raw)
            try:
                while not self._stop.is_set():
                    conn.settimeout(self._idle_timeout_s)
                    msg = recv_msg(conn)
                    if msg is None:
                        return
                    op = msg.get("op")
                    if not isinstance(op, str):
                        raise BadMessageError(f"'op' must be a string, got {type(op).__name__}")
                    if op == "hello":
                        verified = self._hello(conn, msg)
                    elif op in self._open_ops:
                        self._open_ops[op](conn, msg)
                    elif op in self._gated_ops and not verified:
                        send_msg(conn, {"ok": False, "error": f"handshake before {op}"})
                    elif op in self._gated_ops:
                        self._gated_ops[op](conn, msg)
                    else:
                        send_msg(conn, {"ok": False, "error": f"unknown op {op[:64]!r}"})
            except BadMessageError as exc:  # answered; what follows cannot be framed
                logger.debug("KV connection from %s: %s", peer, exc)
                with contextlib.suppress(OSError):
                    send_msg(conn, {"ok": False, "error": str(exc)})
                    linger(conn)  # so the answer is read, not lost to a reset
            except (OSError, TransferError, ValueError) as exc:  # incl. idle timeout
                logger.debug("KV connection closed: %s", exc)
            except Exception:  # a handler's bug: this connection ends, the server serves on
                logger.exception("KV connection from %s failed; closed", peer)


    @contextlib.contextmanager
    def _tracked(self, conn: socket.socket) -> Iterator[None]:
        """``conn`` is served (``close`` ends it) for the duration of the block."""
        with self._conns_lock:
            self._conns.add(conn)
        try:
            yield
        finally:
            with self._conns_lock:
                self._conns.discard(conn)


def _peer_of(conn: socket.socket) -> str:
    try:
        return _address(conn.getpeername())
    except OSError:
        return "?"


def _address(addr: Any) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
