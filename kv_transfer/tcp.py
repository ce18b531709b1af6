"""TCP transport: KV bytes go raw over a socket, straight from and into the
registered KV tensors (``sendall``/``recv_into`` on views; no pickling, no
staging copy for host memory; device memory is staged through host memory).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from .base import PeerAddress
from .layout import KVLayout, as_bytes, chunk_views, paired_runs
from .leases import LeaseError, LeaseTable
from .push_inbox import PushInbox
from .push_wire import layer_chunks, send_push, serve_push, serve_push_abort
from .threads import unpin_current_thread
from .wire import (
    PROTOCOL_VERSION,
    TransferError,
    check_reply,
    compare_compat,
    recv_into_exact,
    recv_msg,
    send_msg,
    set_deadline,
)

logger = logging.getLogger("pdserve.kv_transfer.tcp")

# How long a pull or release waits for the scheduler to announce a lease.
LEASE_WAIT_S = 5.0
# A connection idle this long is closed by the server; clients reuse theirs for half of it.
IDLE_TIMEOUT_S = 300.0
# A decode worker that stops reading for this long loses the transfer.
SEND_TIMEOUT_S = 30.0
_ACCEPT_POLL_S = 1.0
_SOCK_BUF = 4 << 20


class TcpTransport:
    name: ClassVar[str] = "tcp"
    supports_push: ClassVar[bool] = True

    def __init__(self) -> None:
        # Where pushed KV lands on a decode worker (set before ``start``).
        self.inbox: PushInbox | None = None
        # More counters for the ``status`` op (the connector's load statistics).
        self.extra_status: Callable[[], dict[str, int]] | None = None
        self._kv: list[torch.Tensor] = []
        self._layout: KVLayout | None = None
        self._leases: LeaseTable | None = None
        self._compat: dict[str, Any] = {}
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        # Idle client connections per peer, with when each was last used.
        self._pool: dict[PeerAddress, list[tuple[socket.socket, float]]] = {}
        self._pool_lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._stats = dict.fromkeys(
            ("bytes_sent", "bytes_received", "transfers_completed", "transfers_failed",
             "transfer_time_ns", "inflight_pulls"), 0)

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
        self._compat = dict(compat, protocol_version=PROTOCOL_VERSION, transport=self.name)
        listener = socket.create_server((host, port), reuse_port=False, backlog=64)
        listener.settimeout(_ACCEPT_POLL_S)
        self._listener = listener
        threading.Thread(target=self._accept_loop, name="pdserve-kv-accept", daemon=True).start()
        return int(listener.getsockname()[1])

    def close(self) -> None:
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._pool_lock:
            for conns in self._pool.values():
                for conn, _ in conns:
                    conn.close()
            self._pool.clear()

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

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
            _tune(conn)
            threading.Thread(
                target=self._serve_conn, args=(conn,), name="pdserve-kv-conn", daemon=True
            ).start()

    def _serve_conn(self, conn: socket.socket) -> None:
        unpin_current_thread()
        verified = False
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
                    elif op == "pull" and verified:
                        self._on_pull(conn, msg)
                    elif op == "push" and verified:
                        self._count(bytes_received=serve_push(conn, msg, self.inbox))
                    elif op == "push_abort":
                        serve_push_abort(conn, msg, self.inbox)
                    elif op in ("pull", "push"):
                        send_msg(conn, {"ok": False, "error": f"handshake required before {op}"})
                    else:
                        send_msg(conn, {"ok": False, "error": f"unknown op {op!r}"})
            except (OSError, TransferError, ValueError) as exc:  # incl. idle timeout
                logger.debug("KV connection closed: %s", exc)

    def _status(self) -> dict[str, Any]:
        held = self._leases.num_held if self._leases is not None else 0
        expired = self._leases.num_expired if self._leases is not None else 0
        extra = self.extra_status() if self.extra_status is not None else {}
        return {"ok": True, **self.stats(), **extra, "num_leases": held,
                "leases_expired": expired}

    def _on_hello(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        problem = compare_compat(self._compat, msg.get("compat", {}))
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
            send_msg(conn, {"ok": True})
            conn.settimeout(SEND_TIMEOUT_S)
            for chunk in chunk_views(self._kv, self._layout, src_runs):
                sent += _send_chunk(conn, chunk)
            self._count(bytes_sent=sent, transfers_completed=1,
                        transfer_time_ns=time.perf_counter_ns() - start)
        except OSError:
            self._count(bytes_sent=sent, transfers_failed=1)
            raise
        finally:
            self._leases.finish(req)

    # ---- pulling side ----------------------------------------------------------

    def pull(
        self,
        peer: PeerAddress,
        remote_request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        deadline: float,
    ) -> int:
        assert self._layout is not None
        runs = paired_runs(src_block_ids, dst_block_ids)
        self._count(inflight_pulls=1)
        try:
            return self._pull(peer, remote_request_id, runs, deadline)
        finally:
            self._count(inflight_pulls=-1)

    def _pull(
        self, peer: PeerAddress, remote_request_id: str, runs: list[tuple[int, int, int]],
        deadline: float,
    ) -> int:
        assert self._layout is not None
        start = time.perf_counter_ns()
        received = 0
        conn = self._checkout_conn(peer, deadline)
        try:
            send_msg(conn, {"op": "pull", "req": remote_request_id,
                            "runs": [(s, n) for s, _, n in runs]})
            check_reply(recv_msg(conn), f"pull of {remote_request_id} from {peer}")
            dst_runs = [(d, n) for _, d, n in runs]
            for chunk in chunk_views(self._kv, self._layout, dst_runs):
                set_deadline(conn, deadline)
                received += _recv_chunk(conn, chunk)
        except (OSError, TransferError) as exc:
            conn.close()
            self._count(bytes_received=received, transfers_failed=1)
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"pull of {remote_request_id} from {peer} failed: {exc}") from exc
        self._checkin_conn(peer, conn)
        self._count(bytes_received=received, transfers_completed=1,
                    transfer_time_ns=time.perf_counter_ns() - start)
        return received

    def push(
        self,
        peer: PeerAddress,
        transfer_id: str,
        layer: int,
        first_position: int,
        block_ids: Sequence[int],
        num_blocks: int,
        final: bool,
        deadline: float,
        checksum: bool = False,
    ) -> int:
        """Send our ``block_ids`` of one layer into the peer's push inbox at
        positions ``first_position …`` of transfer ``transfer_id``."""
        assert self._layout is not None
        chunks = layer_chunks(self._kv[layer], self._layout.layers[layer], block_ids)
        header = {"xfer": transfer_id, "layer": layer, "first": first_position,
                  "count": len(block_ids), "num_blocks": num_blocks, "final": final}
        conn = self._checkout_conn(peer, deadline)
        try:
            set_deadline(conn, deadline)
            sent = send_push(conn, header, chunks, checksum)
        except (OSError, TransferError) as exc:
            conn.close()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"push of {transfer_id} to {peer} failed: {exc}") from exc
        self._checkin_conn(peer, conn)
        self._count(bytes_sent=sent)
        return sent

    def push_abort(self, peer: PeerAddress, transfer_id: str, why: str, deadline: float) -> None:
        conn = self._checkout_conn(peer, deadline)
        try:
            set_deadline(conn, deadline)
            send_msg(conn, {"op": "push_abort", "xfer": transfer_id, "why": why})
            check_reply(recv_msg(conn), f"push abort of {transfer_id}")
        except (OSError, TransferError) as exc:
            conn.close()
            raise TransferError(f"push abort on {peer} failed: {exc}") from exc
        self._checkin_conn(peer, conn)

    def release(self, peer: PeerAddress, remote_request_id: str, deadline: float) -> None:
        conn = self._checkout_conn(peer, deadline)
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
        self._checkin_conn(peer, conn)

    def _checkout_conn(self, peer: PeerAddress, deadline: float) -> socket.socket:
        with self._pool_lock:
            idle = self._pool.get(peer, [])
            while idle:
                conn, last_used = idle.pop()
                if time.monotonic() - last_used < IDLE_TIMEOUT_S / 2:
                    return conn
                conn.close()  # the peer may have dropped it already
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"deadline exceeded before connecting to {peer}")
        try:
            conn = socket.create_connection((peer.host, peer.port), timeout=remaining)
            _tune(conn)
            set_deadline(conn, deadline)
            send_msg(conn, {"op": "hello", "compat": self._compat})
            check_reply(recv_msg(conn), f"handshake with {peer}")
        except OSError as exc:
            raise TransferError(f"cannot reach KV peer {peer}: {exc}") from exc
        return conn

    def _checkin_conn(self, peer: PeerAddress, conn: socket.socket) -> None:
        with self._pool_lock:
            self._pool.setdefault(peer, []).append((conn, time.monotonic()))


def _tune(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)


def _send_chunk(conn: socket.socket, chunk: torch.Tensor) -> int:
    host = chunk if chunk.device.type == "cpu" else chunk.to("cpu")
    view = as_bytes(host)
    conn.sendall(view)
    return len(view)


def _recv_chunk(conn: socket.socket, chunk: torch.Tensor) -> int:
    if chunk.device.type == "cpu":
        view = as_bytes(chunk)
        recv_into_exact(conn, view)
        return len(view)
    staging = torch.empty(chunk.shape, dtype=chunk.dtype, pin_memory=True)
    view = as_bytes(staging)
    recv_into_exact(conn, view)
    chunk.copy_(staging, non_blocking=False)
    return len(view)
