"""Pull: the decode asks the prefill for leased blocks over the control channel.

A pull is::

    client -> {"op": "pull", "req", "runs", "checksum", **receive.fields}
    server -> {"ok": true} | {"ok": false, "error"}      (lease checked)
    server -> KV bytes over the data path
    server -> {"ok": true, "bytes", "checksum"} | {"ok": false, "error"}   (trailer)

Only the KV bytes take the transport's own data path: a subclass provides
``_send_blocks`` (server) and ``_open_receive`` (client). The cluster KV pool's pulls
(``pool_pull.py``) take the same path with raw bytes.

Under ``--kv-compression`` a pull may name an ``encoding`` instead: the blocks then
travel as the codec's payloads on the control connection (``coded_pull.py`` decides
per pull, from the rate ``links`` measured; ``pool_codec.py`` moves them). Either way
the lease is served by ``_serve_lease``: ended once the blocks are sent, before the
trailer, and on every failure.
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Protocol

import torch

from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.channel import LEASE_WAIT_S, ControlledTransport, Handler
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.integrity import checksum, natural_kind
from pdserve.kv_transfer.layout import chunk_views, paired_runs
from pdserve.kv_transfer.leases import LeaseError

logger = logging.getLogger("pdserve.kv_transfer.control")

# A decode worker that stops reading for this long loses the transfer.
SEND_TIMEOUT_S = 30.0

# Sends a lease's blocks: (request id, its (first block, count) runs, end the lease).
LeaseSend = Callable[[str, list[tuple[int, int]], Callable[[], bool]], object]


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


class PullTransport(ControlledTransport):
    """A controlled transport whose KV moves by pull (``coded_pull.CodedPullTransport``, the
    base of every backend, adds the cluster KV pool)."""

    # True: KV bytes travel on the control connection itself, before the trailer.
    inline_data: ClassVar[bool] = False

    # ---- hooks -----------------------------------------------------------------

    def _send_blocks(self, conn: socket.socket, msg: dict[str, Any],
                     chunks: Sequence[torch.Tensor], first_index: int, deadline: float) -> int:
        raise NotImplementedError

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> DataReceive:
        raise NotImplementedError

    def _on_pull_failed(self, msg: dict[str, Any]) -> None:
        """Server: a send failed; drop per-peer data state so the next pull rebuilds it."""

    def _kv_ops(self) -> dict[str, Handler]:
        return dict(super()._kv_ops(), pull=self._on_pull)

    # ---- serving side ----------------------------------------------------------

    def _on_pull(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        def send(req: str, src_runs: list[tuple[int, int]], end: Callable[[], bool]) -> None:
            assert self._layout is not None
            self._send(conn, msg, list(chunk_views(self._kv, self._layout, src_runs)), req,
                       on_sent=end)

        self._serve_lease(conn, msg, send)

    def _serve_lease(self, conn: socket.socket, msg: dict[str, Any], send: LeaseSend) -> None:
        """Check out the lease ``msg`` names and ``send`` its blocks (``msg``'s runs),
        however they travel. ``send`` gets ``end``, which ends the lease (returning
        True: the blocks are intact) and must run once they are sent, before the
        trailer, so a decode that has the trailer finds the lease ended; the lease is
        ended here on every other path too (a second ``end`` is a no-op)."""
        assert self._leases is not None and self._layout is not None
        leases = self._leases
        req = fields.text(msg, "req")  # read before the lease is touched: a bad pull ends none
        src_runs = fields.block_runs(msg, "runs", self._layout.num_blocks)
        try:
            held = set(leases.checkout(req, LEASE_WAIT_S))
        except LeaseError as exc:
            send_msg(conn, {"ok": False, "error": str(exc)})
            return
        try:
            wanted = {s + i for s, n in src_runs for i in range(n)}
            if not wanted <= held:  # ended before the refusal goes out, as before a
                leases.finish(req)  # trailer: a peer that has it finds the lease ended
                send_msg(conn, {"ok": False, "error": f"blocks {sorted(wanted - held)} not leased"})
                return
            send(req, src_runs, lambda: leases.finish(req) or True)
        finally:
            leases.finish(req)  # a failed send: ended here (a second finish is a no-op)

    def _send(self, conn: socket.socket, msg: dict[str, Any], chunks: list[torch.Tensor],
              what: str, on_sent: Callable[[], bool] | None = None,
              on_outcome: Callable[[bool], None] | None = None) -> bool:
        """Accept, send ``chunks`` on the data path, call ``on_sent`` once they are sent
        (before the trailer: the peer sees no trailer before it ran), then the trailer:
        an error one if ``on_sent`` says the source was rewritten while it was read.

        Every outcome is counted (and ``on_outcome`` told) *before* the trailer or
        error reply goes out: a peer that reads our counters as soon as it has the
        trailer sees the transfer counted. A trailer that cannot be delivered after
        a counted success leaves the count as it is (the bytes did go out)."""
        start = time.perf_counter_ns()
        sent = 0
        outcome: bool | None = None

        def settle(ok: bool, **deltas: int) -> None:
            nonlocal outcome
            outcome = ok
            self._count(bytes_sent=sent, **deltas)
            if on_outcome is not None:
                on_outcome(ok)

        try:
            kind = natural_kind(chunks)
            digest = checksum(chunks, kind) if msg.get("checksum") else None
            send_msg(conn, {"ok": True})
            self._count_sending(1)
            try:
                sent = self._send_paced(conn, msg, chunks)
            finally:
                self._count_sending(-1)
            if on_sent is not None and not on_sent():  # sent whole: the stream is intact
                settle(False, transfers_failed=1)
                send_msg(conn, {"ok": False, "error": "blocks rewritten while sent"})
                return False
            settle(True, transfers_completed=1, transfer_time_ns=time.perf_counter_ns() - start)
            send_msg(conn, {"ok": True, "bytes": sent, "checksum": digest,
                            "checksum_kind": kind})
            return True
        except (OSError, TransferError) as exc:
            if outcome is None:
                settle(False, transfers_failed=1)
            self._on_pull_failed(msg)
            logger.warning("KV send of %s failed: %s", what, exc)
            if not self.inline_data and not isinstance(exc, OSError):
                send_msg(conn, {"ok": False, "error": f"send failed: {exc}"})
            raise

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
        chunks = list(chunk_views(self._kv, self._layout, [(d, n) for _, d, n in runs]))
        return self._receive_into(peer, {"op": "pull", "req": remote_request_id,
                                         "runs": [(s, n) for s, _, n in runs]},
                                  chunks, deadline, f"pull of {remote_request_id} from {peer}",
                                  sum(n for _, _, n in runs))

    def _receive_into(self, peer: PeerAddress, request: dict[str, Any],
                      chunks: list[torch.Tensor], deadline: float, what: str,
                      num_blocks: int) -> int:
        """``chunks`` (``num_blocks`` blocks) filled from ``peer``; the path's rate is
        recorded in ``links``."""
        start = time.perf_counter_ns()
        conn = self._pool.checkout(peer, deadline, self._compat)
        session: DataReceive | None = None
        received = 0
        try:
            session = self._open_receive(peer, conn, chunks, deadline)
            stall_s = self.options.stall_s
            # The first reply may come LEASE_WAIT_S late: a lease the peer's scheduler
            # announces after the pull arrives (the peer is not silent, it waits).
            set_deadline(conn, deadline, None if stall_s is None else stall_s + LEASE_WAIT_S)
            send_msg(conn, {**request, "checksum": self.options.checksum, **session.fields})
            check_reply(recv_msg(conn), what)
            data_start = time.perf_counter_ns()  # the lease found: the link's time from here
            if self.inline_data:
                received = session.receive(conn, deadline)
            set_deadline(conn, deadline, stall_s)
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
        end = time.perf_counter_ns()
        self._count(bytes_received=received, transfers_completed=1,
                    transfer_time_ns=end - start)
        assert self._layout is not None
        self.links.record(f"{peer.host}:{peer.port}", received,
                          num_blocks * self._layout.block_size, (end - data_start) / 1e9)
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
