"""One fuzz input on one fresh connection, and what the server did with it.

The outcome is what the server answered to the fuzzed bytes (after the preamble's
own replies): ``error`` (any ``{"ok": false, ...}``), ``ok`` (only ok), ``closed`` (the connection
ended with no answer), ``hung`` (no EOF by the client's deadline: a server that
holds a connection it should have dropped), or ``refused`` (could not connect: the
listener is gone). A stalled input's outcome is ``closed`` when the server dropped
it by ``stall_deadline_s``, else ``hung``.
"""

from __future__ import annotations

import json
import socket
import ssl
import struct
import time
from dataclasses import dataclass
from typing import Any

from pdserve.bench.fuzz.kv_inputs import KvInput
from pdserve.bench.fuzz.kv_mutate import frame
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.control.auth import authenticate_to_server
from pdserve.kv_transfer.control.wire import TransferError

OUTCOMES = ("error", "ok", "closed", "hung", "refused")


@dataclass(frozen=True)
class Peer:
    """Where a fuzzed port listens, and how a client that plays by the rules gets in:
    the cluster ``secret`` (None: the port has none), the ``compat`` its hello takes."""

    host: str
    port: int
    compat: dict[str, Any]
    secret: ClusterSecret | None = None

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of OUTCOMES
    seconds: float  # from the last byte sent to the end
    reply: dict[str, Any] | None = None


def send_input(peer: Peer, item: KvInput, answer_s: float, stall_deadline_s: float
               ) -> Outcome:
    """Run ``item`` against ``peer``. ``answer_s``: how long a server may take to answer
    and close after the client's half-close (the lease wait of a slow input included)."""
    try:
        sock = socket.create_connection((peer.host, peer.port), timeout=answer_s)
    except OSError:
        return Outcome("refused", 0.0)
    with sock:
        skip = 0
        try:
            if item.auth and peer.secret is not None:
                authenticate_to_server(sock, peer.secret, time.monotonic() + answer_s,
                                       str(peer))
            prefix = frame({"op": "hello", "compat": peer.compat}) if item.hello else b""
            skip = 1 if item.hello else 0
            sock.settimeout(answer_s)
            sock.sendall(prefix + item.data)
            if item.end == "close":  # gone without reading: the server's answer hits a
                return Outcome("closed", 0.0)  # closed socket
            if item.end == "eof":
                sock.shutdown(socket.SHUT_WR)
        except (OSError, TransferError):
            pass  # the server closed on us mid-send: read what it said before
        sent = time.monotonic()
        limit = stall_deadline_s if item.end == "stall" else answer_s
        data, eof = read_until_eof(sock, sent + limit)
    seconds = time.monotonic() - sent
    if not eof:
        return Outcome("hung", seconds)
    replies = frames(data)[skip:]
    if not replies:
        return Outcome("closed", seconds)
    refusal = next((r for r in replies if r.get("ok") is not True), None)
    return Outcome("ok" if refusal is None else "error", seconds, refusal or replies[0])


def read_until_eof(sock: socket.socket, deadline: float) -> tuple[bytes, bool]:
    """Everything the peer sends until it closes (True) or ``deadline`` (False)."""
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return b"".join(chunks), False
        sock.settimeout(remaining)
        try:
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            return b"".join(chunks), False
        except (OSError, ssl.SSLError):  # reset: the server closed with our bytes unread
            return b"".join(chunks), True
        if not chunk:
            return b"".join(chunks), True
        chunks.append(chunk)


def frames(data: bytes) -> list[dict[str, Any]]:
    """The control messages at the start of ``data``, up to the first thing that is not
    one (the raw KV bytes of a pull follow its first reply) or a cut one."""
    out: list[dict[str, Any]] = []
    pos = 0
    while len(data) >= pos + 4:
        (size,) = struct.unpack_from("!I", data, pos)
        body = data[pos + 4:pos + 4 + size]
        if len(body) < size:
            break
        try:
            msg = json.loads(body)
        except ValueError:
            break
        if not isinstance(msg, dict):
            break
        out.append(msg)
        pos += 4 + size
    return out
