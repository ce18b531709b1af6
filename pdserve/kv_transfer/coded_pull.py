"""The P->D handoff's encoded pulls: a decode worker whose ``--kv-compression`` is not
``none`` asks the prefill for a lease's blocks encoded by its codec where that is
estimated faster on the path (``handoff_codec.py``: the link's measured rate against
the codec's ratio and cost), and raw otherwise.

An encoded pull::

    client -> {"op": "pull", "req", "runs", "checksum", "encoding"}
    server -> {"ok": false, "incompatible": true, "error"}   (another encoding)
            | pool_codec.py's stream: one payload per leased block, in the runs' order,
              and a trailer with the prefill's ``encode_ns``

A pull without ``encoding`` is ``pull.py``'s raw pull, whatever either side's setting.
A prefill whose encoding differs refuses before it touches the lease, so the decode
pulls the same lease raw in the same call, and pulls raw from that peer until the
link meter's max age has passed (one mismatch costs one round trip, not one a pull).
Either way the lease is served by ``pull.py``'s ``_serve_lease``: ended once the blocks
are sent, before the trailer, and on every failure; the serve is counted before the
trailer (``PoolCodec.serve``). An encoded pull that fails past the refusal (the peer
gone or silent for ``stall_s``, a payload that does not decode, a checksum) is a
``TransferError``, as a raw one's: the decode recomputes, and the prefill has ended
the lease.

Counted on the puller: ``encoded_pulls``, ``encoded_bytes_saved`` (raw minus wire
bytes, never below 0) and ``encoded_pull_refusals``; an encoded pull's wire bytes go
to ``bytes_received`` and its rate to ``links`` (wire bytes over its time: see
``handoff_codec.py`` for why, and how the decision reads such a sample back).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import torch

from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.wire import IncompatiblePeerError, TransferError, send_msg
from pdserve.kv_transfer.handoff_codec import HandoffCodec
from pdserve.kv_transfer.layout import KVLayout, block_views
from pdserve.kv_transfer.pool_codec import PoolChecksumError, PoolCodec, Receipt
from pdserve.kv_transfer.pool_pull import PooledTransport
from pdserve.kv_transfer.remote.compression import BlockCodec

logger = logging.getLogger("pdserve.kv_transfer.control")
LOSSLESS = ("none", "lossless")  # the codecs that keep every bit


class EncodingRefusedError(IncompatiblePeerError):
    """The prefill encodes its blocks otherwise (another ``--kv-compression``)."""


class CodedPullTransport(PooledTransport):
    """A pooled transport whose P->D pulls move encoded blocks where that pays; the
    base of every backend."""

    _handoff: HandoffCodec | None = None  # None: every pull is raw

    def use_pool_codec(self, codec: BlockCodec) -> None:
        """The pool's encoding is the handoff's too (one ``--kv-compression``), if it
        is lossless or ``handoff_lossy`` allows a lossy one: a handoff's KV is computed
        fresh, and a lossy copy of it would change the answer of every long prompt sent
        over a thin path, where the store and the pool trade that for hits."""
        super().use_pool_codec(codec)
        lossy = codec.name not in LOSSLESS
        self._handoff = None if self._pool_codec is None or (
            lossy and not self.options.handoff_lossy) else HandoffCodec(
            codec.name, self.options.link_max_age_s)

    # ---- serving side ----------------------------------------------------------

    def _on_pull(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        if "encoding" not in msg:
            super()._on_pull(conn, msg)
            return
        encoding = fields.text(msg, "encoding", 64)
        codec = self._pool_codec
        if codec is None or encoding != codec.encoding:  # before the lease is touched
            send_msg(conn, {"ok": False, "incompatible": True, "error": (
                f"KV blocks encoded as {self._pool_encoding!r} here (--kv-compression),"
                f" the pull asks for {encoding!r}")})
            return
        checksum = fields.flag(msg, "checksum", False)

        def send(req: str, src_runs: list[tuple[int, int]], end: Callable[[], bool]) -> None:
            assert self._layout is not None
            blocks = [block_views(self._kv, self._layout, s + i)
                      for s, n in src_runs for i in range(n)]

            def finish(_ok: bool) -> None:  # before an error trailer too
                end()

            # ``end`` as "unchanged": leased blocks are not rewritten while they are sent,
            # and it ends the lease once they are, before the trailer.
            self._count_sending(1)
            try:
                codec.serve(conn, blocks, end, checksum, finish, self._count,
                            self.options.throttle_bytes_per_s, self._stop.wait)
            finally:
                self._count_sending(-1)

        self._serve_lease(conn, msg, send)

    # ---- pulling side ----------------------------------------------------------

    def _pull(self, peer: PeerAddress, remote_request_id: str,
              runs: list[tuple[int, int, int]], deadline: float) -> int:
        """Encoded where ``handoff`` says it pays on this path, else raw; a refusal of
        the encoding is answered by a raw pull of the same lease (the peer has not
        touched it)."""
        handoff, codec, layout = self._handoff, self._pool_codec, self._layout
        name = f"{peer.host}:{peer.port}"
        if handoff is None or codec is None or layout is None or not handoff.encode(
                name, self.links.estimate(name), _block_bytes(layout) / layout.block_size,
                _element_size(layout)):
            return super()._pull(peer, remote_request_id, runs, deadline)
        try:
            return self._pull_lease_encoded(peer, name, remote_request_id, runs, deadline,
                                            codec, handoff)
        except EncodingRefusedError as exc:
            handoff.refused_by(name)
            self._count(encoded_pull_refusals=1)
            logger.warning("%s refused an encoded KV pull (%s); pulling raw from it for "
                           "%.0f s", name, exc, self.options.link_max_age_s)
        except TransferError:
            # Whatever broke it (a cut link, a bad payload, or a prefill of a release
            # that ignores "encoding" and sends raw bytes, which read as a length out of
            # bounds), that peer's next pulls are raw for a while: one failed pull, then
            # the path that works with every release. This one fails (decode recomputes).
            handoff.refused_by(name)
            raise
        return super()._pull(peer, remote_request_id, runs, deadline)

    def _pull_lease_encoded(self, peer: PeerAddress, name: str, remote_request_id: str,
                            runs: list[tuple[int, int, int]], deadline: float,
                            codec: PoolCodec, handoff: HandoffCodec) -> int:
        """The wire bytes; ``EncodingRefusedError`` before anything was written, or
        ``TransferError`` (counted as failed) once the pull broke."""
        assert self._layout is not None
        layout, checksum = self._layout, self.options.checksum
        blocks = [block_views(self._kv, layout, d + i) for _, d, n in runs for i in range(n)]
        request = {"op": "pull", "req": remote_request_id, "checksum": checksum,
                   "runs": [(s, n) for s, _, n in runs], "encoding": codec.encoding}
        what = f"encoded pull of {remote_request_id} from {peer}"
        receipts: list[Receipt] = []

        def exchange(conn: socket.socket) -> int:
            send_msg(conn, request)
            try:
                receipts.append(codec.receive(conn, blocks, checksum, deadline, what,
                                              self.options.stall_s))
            except IncompatiblePeerError as exc:  # the first reply: nothing was written
                raise EncodingRefusedError(str(exc)) from exc
            return receipts[0].nbytes

        start = time.perf_counter_ns()
        try:
            wire = self._control(peer, deadline, what, exchange)
        except EncodingRefusedError:
            raise
        except TransferError as exc:
            self._count(transfers_failed=1,
                        checksum_failures=int(isinstance(exc, PoolChecksumError)))
            raise
        raw, receipt = len(blocks) * _block_bytes(layout), receipts[0]
        self._count(bytes_received=wire, transfers_completed=1,
                    transfer_time_ns=time.perf_counter_ns() - start, encoded_pulls=1,
                    encoded_bytes_saved=max(raw - wire, 0))
        self.links.record(name, wire, len(blocks) * layout.block_size, receipt.data_ns / 1e9)
        handoff.record(raw, wire, (receipt.encode_ns + receipt.decode_ns) / 1e9)
        return wire


def _block_bytes(layout: KVLayout) -> int:
    """One block's raw bytes, every layer."""
    total = 0
    for lay in layout.layers:
        numel = 1
        for i, d in enumerate(lay.shape):
            numel *= 1 if i == lay.block_dim else d
        total += numel * int(getattr(torch, lay.dtype).itemsize)
    return total


def _element_size(layout: KVLayout) -> int:
    """The cache's element size: what the codecs' priors depend on."""
    dtype = getattr(torch, layout.layers[0].dtype)
    return int(dtype.itemsize)
