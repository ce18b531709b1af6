"""The control channel every transport shares, and the pull around its data path.

Each transport listens on one TCP port for control messages (``wire.py``):
``hello`` (the handshake), ``status``, ``release``, ``pull`` and any setup ops of
its own. Only the KV bytes take the transport's own path. A pull is::

    client -> {"op": "pull", "req", "runs", "checksum", **receive.fields}
    server -> {"ok": true} | {"ok": false, "error"}      (lease checked)
    server -> KV bytes over the data path
    server -> {"ok": true, "bytes", "checksum"} | {"ok": false, "error"}   (trailer)

A subclass provides ``_send_blocks`` (server) and ``_open_receive`` (client).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch

from .base import PeerAddress, TransportOptions
from .integrity import checksum, natural_kind
from .layout import KVLayout, chunk_views, paired_runs
from .leases import LeaseError, LeaseTable
from .pool import ConnectionPool
from .threads import unpin_current_thread
from .wire import (
    PROTOCOL_VERSION,
    TransferError,
    check_reply,
    compare_compat,
    recv_msg,
    send_msg,
    set_deadline,
    tune,
)

logger = logging.getLogger("pdserve.kv_transfer.control")

# How long a pull or release waits for the scheduler to announce a lease.
LEASE_WAIT_S = 5.0
# A connection idle this long is closed by the server; clients reuse theirs for half of it.
IDLE_TIMEOUT_S = 300.0
# A decode worker that stops reading for this long loses the transfer.
SEND_TIMEOUT_S = 30.0
_ACCEPT_POLL_S = 1.0

Handler = Callable[[socket.socket, dict[str, Any]], None]


class DataReceive(Protocol):
    """The receiving end of one pull on the data path.

    Created before the pull message is sent (so buffers are posted before data
    can arrive); ``fields`` travel in the pull message. ``receive`` returns the
    bytes written into the destination chunks or raises ``TransferError`` by
    ``deadline``; ``abort`` cancels whatever is outstanding so nothing writes
    into the caller's blocks afterwards. Idempotent.
    """

    fields: dict[str, Any]

    def receive(self, conn: socket.socket, deadline: float) -> int: ...

    def abort(self) -> None: ...


class ControlledTransport:
    name: ClassVar[str]
    # True: KV bytes travel on the control connection itself, before the trailer.
    inline_data: ClassVar[bool] = False

    def __init__(self, options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self._kv: list[torch.Tensor] = []
        self._layout: KVLayout | None = None
        self._leases: LeaseTable | None = None
        self._compat: dict[str, Any] = {}
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._pool = ConnectionPool(IDLE_TIMEOUT_S / 2)
        self._stats_lock = threading.Lock()
        self._num_sending = 0  # a gauge, shown by the status op only
        # More counters for the ``status`` op (the connector's load statistics).
        self.extra_status: Callable[[], dict[str, int]] | None = None
        self._stats = dict.fromkeys(
            ("bytes_sent", "bytes_received", "transfers_completed", "transfers_failed",
             "transfer_time_ns", "inflight_pulls", "checksum_failures"), 0)

    # ---- hooks -----------------------------------------------------------------

    def _start_data(self, host: str) -> dict[str, Any]:
        """Start the data path; returns what goes into the handshake's compat."""
        return {}

    def _close_data(self) -> None:
        return

    def _extra_ops(self) -> dict[str, Handler]:
        return {}

    def _send_blocks(self, conn: socket.socket, msg: dict[str, Any],
                     chunks: Sequence[torch.Tensor], first_index: int, deadline: float) -> int:
        raise NotImplementedError

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> DataReceive:
        raise NotImplementedError

    def _on_pull_failed(self, msg: dict[str, Any]) -> None:
        """Server: a send failed; drop per-peer data state so the next pull rebuilds it."""

    # ---- lifecycle -------------------------------------------------------------

    def start(
        self,
        *,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        leases: LeaseTable,
        compat: dict[str, Any],
        host: str,
        port: int,
    ) -> int:
        self._kv, self._layout, self._leases = list(kv_caches), layout, leases
        extra = self._start_data(host)
        self._compat = dict(compat, **extra, protocol_version=PROTOCOL_VERSION,
                            transport=self.name)
        listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="pdserve-kv-accept", daemon=True).start()
        return int(listener.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        self._pool.close()
        self._close_data()

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def _count_sending(self, delta: int) -> None:
        with self._stats_lock:
            self._num_sending += delta

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self._stats[key] += value

    # ---- serving side ----------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None
        unpin_current_thread()
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            tune(conn)
            threading.Thread(
                target=self._serve_conn, args=(conn,), name="pdserve-kv-conn", daemon=True
            ).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        unpin_current_thread()
        verified = False
        extra = self._extra_ops()
        with conn:
            try:
                while not self._stop.is_set():
                    conn.settimeout(IDLE_TIMEOUT_S)
                    msg = recv_msg(conn)
                    if msg is None:
                        return
                    op = msg.get("op")
                    if op == "hello":
                        verified = self._on_hello(conn, msg)
                    elif op == "status":
                        send_msg(conn, self._status())
                    elif op == "release":
                        self._on_release(conn, msg)
                    elif op in extra or op == "pull":
                        if not verified:
                            send_msg(conn, {"ok": False, "error": f"handshake before {op}"})
                        elif op == "pull":
                            self._on_pull(conn, msg)
                        else:
                            extra[op](conn, msg)
                    else:
                        send_msg(conn, {"ok": False, "error": f"unknown op {op!r}"})
            except (OSError, TransferError, ValueError) as exc:  # incl. idle timeout
                logger.debug("KV connection closed: %s", exc)

    def _status(self) -> dict[str, Any]:
        held = self._leases.num_held if self._leases is not None else 0
        expired = self._leases.num_expired if self._leases is not None else 0
        extra = self.extra_status() if self.extra_status is not None else {}
        return {"ok": True, **self.stats(), **extra, "num_leases": held,
                "leases_expired": expired, "num_sending": self._num_sending}

    def _on_hello(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        problem = compare_compat(self._compat, msg.get("compat", {}), "server", "client")
        if problem:
            send_msg(conn, {"ok": False, "incompatible": True, "error": problem})
            return False
        send_msg(conn, {"ok": True, "compat": self._compat})
        return True

    def _on_release(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self._leases is not None
        found = self._leases.wait_and_finish(str(msg["req"]), LEASE_WAIT_S, "released")
        send_msg(conn, {"ok": True, "found": found})

    def _on_pull(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self._leases is not None and self._layout is not None
        req = str(msg["req"])
        src_runs = [(int(s), int(n)) for s, n in msg["runs"]]
        try:
            held = set(self._leases.checkout(req, LEASE_WAIT_S))
        except LeaseError as exc:
            send_msg(conn, {"ok": False, "error": str(exc)})
            return
        start = time.perf_counter_ns()
        sent = 0
        try:
            wanted = {s + i for s, n in src_runs for i in range(n)}
            if not wanted <= held:
                send_msg(conn, {"ok": False, "error": f"blocks {sorted(wanted - held)} not leased"})
                return
            chunks = list(chunk_views(self._kv, self._layout, src_runs))
            kind = natural_kind(chunks)
            digest = checksum(chunks, kind) if msg.get("checksum") else None
            send_msg(conn, {"ok": True})
            self._count_sending(1)
            try:
                sent = self._send_paced(conn, msg, chunks)
            finally:
                self._count_sending(-1)
            send_msg(conn, {"ok": True, "bytes": sent, "checksum": digest,
                            "checksum_kind": kind})
            self._count(bytes_sent=sent, transfers_completed=1,
                        transfer_time_ns=time.perf_counter_ns() - start)
        except (OSError, TransferError) as exc:
            self._count(bytes_sent=sent, transfers_failed=1)
            self._on_pull_failed(msg)
            logger.warning("KV send of %s failed: %s", req, exc)
            if not self.inline_data and not isinstance(exc, OSError):
                send_msg(conn, {"ok": False, "error": f"send failed: {exc}"})
            raise
        finally:
            self._leases.finish(req)

    def _send_paced(self, conn: socket.socket, msg: dict[str, Any],
                    chunks: Sequence[torch.Tensor]) -> int:
        """All chunks at once, or one at a time at ``throttle_bytes_per_s``."""
        rate = self.options.throttle_bytes_per_s
        total = sum(c.numel() * c.element_size() for c in chunks)
        deadline = time.monotonic() + SEND_TIMEOUT_S + (total / rate if rate else 0.0)
        if not rate:
            return self._send_blocks(conn, msg, chunks, 0, deadline)
        started = time.monotonic()
        sent = 0
        for i, chunk in enumerate(chunks):
            sent += self._send_blocks(conn, msg, [chunk], i, deadline)
            ahead = started + sent / rate - time.monotonic()
            if ahead > 0:
                self._stop.wait(ahead)
        return sent

    # ---- pulling side ----------------------------------------------------------

    def pull(
        self,
        peer: PeerAddress,
        remote_request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        deadline: float,
    ) -> int:
        runs = paired_runs(src_block_ids, dst_block_ids)
        self._count(inflight_pulls=1)
        try:
            return self._pull(peer, remote_request_id, runs, deadline)
        finally:
            self._count(inflight_pulls=-1)

    def _pull(self, peer: PeerAddress, remote_request_id: str,
              runs: list[tuple[int, int, int]], deadline: float) -> int:
        assert self._layout is not None
        start = time.perf_counter_ns()
        what = f"pull of {remote_request_id} from {peer}"
        chunks = list(chunk_views(self._kv, self._layout, [(d, n) for _, d, n in runs]))
        conn = self._pool.checkout(peer, deadline, self._compat)
        session: DataReceive | None = None
        received = 0
        try:
            session = self._open_receive(peer, conn, chunks, deadline)
            set_deadline(conn, deadline)
            send_msg(conn, {"op": "pull", "req": remote_request_id,
                            "runs": [(s, n) for s, _, n in runs],
                            "checksum": self.options.checksum, **session.fields})
            check_reply(recv_msg(conn), what)
            if self.inline_data:
                received = session.receive(conn, deadline)
            set_deadline(conn, deadline)
            trailer = check_reply(recv_msg(conn), what)
            if not self.inline_data:
                received = session.receive(conn, deadline)
            self._verify(trailer, chunks, what)
        except (OSError, TransferError) as exc:
            if session is not None:
                session.abort()
            conn.close()
            self._count(transfers_failed=1)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"{what} failed: {exc}") from exc
        self._pool.checkin(peer, conn)
        self._count(bytes_received=received, transfers_completed=1,
                    transfer_time_ns=time.perf_counter_ns() - start)
        return received

    def _verify(self, trailer: dict[str, Any], chunks: Sequence[torch.Tensor], what: str) -> None:
        if not self.options.checksum:
            return
        try:
            want, got = trailer.get("checksum"), checksum(chunks, str(trailer["checksum_kind"]))
        except (KeyError, ValueError) as exc:
            raise TransferError(f"{what}: no usable checksum in the trailer ({exc})") from exc
        if want != got:
            self._count(checksum_failures=1)
            raise TransferError(f"{what}: checksum mismatch (sender {want}, received {got})")

    def release(self, peer: PeerAddress, remote_request_id: str, deadline: float) -> None:
        conn = self._pool.checkout(peer, deadline, self._compat)
        try:
            set_deadline(conn, deadline)
            send_msg(conn, {"op": "release", "req": remote_request_id})
            check_reply(recv_msg(conn), f"release of {remote_request_id} on {peer}")
        except OSError as exc:
            conn.close()
            raise TransferError(f"release on {peer} failed: {exc}") from exc
        except TransferError:
            conn.close()
            raise
        self._pool.checkin(peer, conn)
