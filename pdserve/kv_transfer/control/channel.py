"""The control channel every transport shares.

Each transport listens on one TCP port for control messages (``wire.py``):
``hello`` (the handshake), ``status``, ``release``, and the ops that move KV
(``pull.py``, a transport's own setup and push ops). Only the KV bytes take
the transport's own path. Client requests are short ``_control`` exchanges on
pooled, handshaken connections.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from pdserve.core.cluster_secret import num_refusals
from pdserve.kv_transfer.base import PeerAddress, PushChannel, TransportOptions
from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.pool import ConnectionPool
from pdserve.kv_transfer.control.server import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_LOGINS,
    ControlServer,
    Handler,
)
from pdserve.kv_transfer.control.wire import (
    PROTOCOL_VERSION,
    TransferError,
    check_reply,
    compare_compat,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.handoff_codec import STATS as ENCODED_STATS
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.links import LinkMeter

# How long a pull or release waits for the scheduler to announce a lease.
LEASE_WAIT_S = 5.0

__all__ = ["LEASE_WAIT_S", "ControlledTransport", "Handler"]


class ControlledTransport:
    name: ClassVar[str]

    def __init__(self, options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        self._kv: list[torch.Tensor] = []
        self._layout: KVLayout | None = None
        self._leases: LeaseTable | None = None
        self._compat: dict[str, Any] = {}
        self._server: ControlServer | None = None
        self._stop = threading.Event()
        self._idle_timeout_s = self.options.idle_timeout_s or IDLE_TIMEOUT_S
        self._pool = ConnectionPool(self._idle_timeout_s / 2, self.options.secret,
                                    self.options.tls, self.options.stall_s)
        self._stats_lock = threading.Lock()
        self._num_sending = 0  # a gauge, shown by the status op only
        # More counters for the ``status`` op (the connector's load statistics).
        self._extra_status: Callable[[], dict[str, int]] | None = None
        # The rate each peer's pulls came at (pull.py records, the status op reports).
        self.links = LinkMeter(self.options.link_max_age_s)
        self._stats = dict.fromkeys(
            ("bytes_sent", "bytes_received", "transfers_completed", "transfers_failed",
             "transfer_time_ns", "inflight_pulls", "checksum_failures",
             "pool_serve_refusals", *ENCODED_STATS), 0)

    # ---- hooks -----------------------------------------------------------------

    def _start_data(self, host: str) -> dict[str, Any]:
        """Start the data path; returns what goes into the handshake's compat."""
        return {}

    def _close_data(self) -> None:
        return

    def _extra_ops(self) -> dict[str, Handler]:
        """A transport's own ops, served after the handshake."""
        return {}

    def _kv_ops(self) -> dict[str, Handler]:
        """Every op served only after the handshake (they touch KV)."""
        return self._extra_ops()

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
        self._server = ControlServer(
            self._on_hello,
            {"status": lambda conn, _: send_msg(conn, self._status()), "release": self._on_release},
            self._kv_ops(),
            self._stop,
            self.options.secret,
            self.options.tls,
            self._idle_timeout_s,
            self.options.max_connections or MAX_CONNECTIONS,
            self.options.max_logins or MAX_LOGINS,
        )
        return self._server.start(host, port)

    def close(self) -> None:
        self._stop.set()
        if self._server is not None:
            self._server.close()
        self._pool.close()
        self._close_data()

    def stats(self) -> dict[str, int]:
        with self._stats_lock:
            return dict(self._stats)

    def add_status(self, source: Callable[[], dict[str, int]]) -> None:
        self._extra_status = source

    def push_channel(self) -> PushChannel | None:
        return None  # a transport that can push overrides this

    def _count_sending(self, delta: int) -> None:
        with self._stats_lock:
            self._num_sending += delta

    def _count(self, **deltas: int) -> None:
        with self._stats_lock:
            for key, value in deltas.items():
                self._stats[key] += value

    # ---- serving side ----------------------------------------------------------

    def _status(self) -> dict[str, Any]:
        held = self._leases.num_held if self._leases is not None else 0
        expired = self._leases.num_expired if self._leases is not None else 0
        extra = self._extra_status() if self._extra_status is not None else {}
        return {"ok": True, **self.stats(), **extra, "num_leases": held,
                "leases_expired": expired, "num_sending": self._num_sending,
                "kv_auth_refusals": num_refusals("kv"), "links": self.links.status()}

    def _on_hello(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        problem = compare_compat(self._compat, fields.obj(msg, "compat"), "server", "client")
        if problem:
            send_msg(conn, {"ok": False, "incompatible": True, "error": problem})
            return False
        send_msg(conn, {"ok": True, "compat": self._compat})
        return True

    def _on_release(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        assert self._leases is not None
        found = self._leases.wait_and_finish(fields.text(msg, "req"), LEASE_WAIT_S, "released")
        send_msg(conn, {"ok": True, "found": found})

    def release(self, peer: PeerAddress, remote_request_id: str, deadline: float) -> None:
        what = f"release of {remote_request_id} on {peer}"

        def exchange(conn: socket.socket) -> int:
            send_msg(conn, {"op": "release", "req": remote_request_id})
            check_reply(recv_msg(conn), what)
            return 0

        self._control(peer, deadline, what, exchange)

    def _control(self, peer: PeerAddress, deadline: float, what: str,
                 exchange: Callable[[socket.socket], int]) -> int:
        """One request/reply ``exchange`` on a pooled, handshaken connection to
        ``peer``; a failed connection is closed, never reused, and every failure
        is a ``TransferError``."""
        conn = self._pool.checkout(peer, deadline, self._compat)
        try:
            set_deadline(conn, deadline)
            result = exchange(conn)
        except (OSError, TransferError) as exc:
            conn.close()
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"{what} failed: {exc}") from exc
        except BaseException:  # anything else (a decode's tensor error): never reused
            conn.close()
            raise
        self._pool.checkin(peer, conn)
        return result
