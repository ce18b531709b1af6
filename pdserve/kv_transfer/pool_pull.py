"""The cluster KV pool over a pull transport: a peer pulls blocks of this worker's host
tier, named by their prefix-cache hashes, into its own cache (``pool_pull``).

A raw pool pull (``--kv-compression none``) is ``pull.py``'s exchange, its bytes on the
transport's data path; with a codec it moves the codec's payloads on the control
connection (``pool_codec.py``). Either way the pull names its encoding and a peer whose
own differs refuses it (``incompatible``; counted as ``pool_serve_refusals``) before it
reads a block.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.channel import Handler
from pdserve.kv_transfer.control.wire import TransferError, send_msg
from pdserve.kv_transfer.layout import block_views, chunk_views
from pdserve.kv_transfer.pool_codec import RAW, PoolChecksumError, PoolCodec
from pdserve.kv_transfer.pull import PullTransport
from pdserve.kv_transfer.remote.compression import BlockCodec


class PoolServe(Protocol):
    """One pool pull being served: the blocks' bytes (``chunks``, in the order a pull
    of single-block runs reads them; ``blocks``, each block's layers, as a codec reads
    them), whether they are still those blocks once sent (``unchanged``), and
    ``finish`` (called once, with whether the send succeeded)."""

    chunks: list[torch.Tensor]
    blocks: list[list[torch.Tensor]]

    def unchanged(self) -> bool: ...

    def finish(self, ok: bool) -> None: ...


# Resolves a pool pull's block hashes; raises ``TransferError`` if one is not held.
PoolServeSource = Callable[[list[bytes]], PoolServe]


class PooledTransport(PullTransport):
    """A pull transport that also serves and pulls the cluster KV pool
    (``coded_pull.CodedPullTransport`` adds encoded handoffs: the base of every
    backend)."""

    _pool_source: PoolServeSource | None = None
    _pool_codec: PoolCodec | None = None  # None: the pool moves raw bytes ("none")

    def _kv_ops(self) -> dict[str, Handler]:
        return dict(super()._kv_ops(), pool_pull=self._on_pool_pull)

    def serve_pool(self, source: PoolServeSource) -> None:
        """Serve peers' pool pulls from ``source`` (the host tier); without, refuse them."""
        self._pool_source = source

    def use_pool_codec(self, codec: BlockCodec) -> None:
        """Pull and serve pool blocks encoded by ``codec``; refuse other encodings."""
        self._pool_codec = None if codec.name == RAW else PoolCodec(codec)

    @property
    def _pool_encoding(self) -> str:
        return RAW if self._pool_codec is None else self._pool_codec.encoding

    # ---- serving side ----------------------------------------------------------

    def _on_pool_pull(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """A peer pulls blocks held in this worker's host tier, named by hash (the
        cluster KV pool). Refused (the peer recomputes) when any is not held; the
        trailer fails if a slot was rewritten while it was being sent."""
        if self._pool_source is None:
            send_msg(conn, {"ok": False, "error": "this worker serves no KV pool"})
            return
        encoding = fields.text(msg, "encoding", 64) if "encoding" in msg else RAW
        if encoding != self._pool_encoding:  # before any block is read: never misread
            self._count(pool_serve_refusals=1)
            send_msg(conn, {"ok": False, "incompatible": True, "error": (
                f"KV pool blocks encoded as {self._pool_encoding!r} here (--kv-compression),"
                f" the pull asks for {encoding!r}")})
            return
        try:
            hashes = [bytes.fromhex(str(h)) for h in msg["hashes"]]
            what = f"pool pull of {len(hashes)} blocks"
            serve = self._pool_source(hashes)
        except (TransferError, ValueError, KeyError, TypeError) as exc:
            send_msg(conn, {"ok": False, "error": str(exc)})
            return
        finished = False

        def finish(ok: bool) -> None:
            nonlocal finished
            finished = True
            serve.finish(ok)

        try:
            if self._pool_codec is not None:
                self._pool_codec.serve(conn, serve.blocks, serve.unchanged,
                                       fields.flag(msg, "checksum", False), finish,
                                       self._count, self.options.throttle_bytes_per_s,
                                       self._stop.wait)
            else:
                self._send(conn, msg, serve.chunks, what, on_sent=serve.unchanged,
                           on_outcome=finish)
        finally:
            if not finished:
                serve.finish(False)

    # ---- pulling side ----------------------------------------------------------

    def pull_pool(self, peer: PeerAddress, hashes: Sequence[bytes],
                  dst_block_ids: Sequence[int], deadline: float) -> int:
        """Copy the blocks named ``hashes`` from the peer's host tier into our
        ``dst_block_ids`` (the cluster KV pool); bytes moved, or ``TransferError``
        (the peer no longer holds one, is gone, or the bytes fail their check)."""
        assert self._layout is not None
        if len(hashes) != len(dst_block_ids):
            raise ValueError(f"{len(hashes)} hashes for {len(dst_block_ids)} blocks")
        request = {"op": "pool_pull", "hashes": [h.hex() for h in hashes],
                   "encoding": self._pool_encoding}
        what = f"pool pull from {peer}"
        self._count(inflight_pulls=1)
        try:
            if self._pool_codec is not None:
                blocks = [block_views(self._kv, self._layout, d) for d in dst_block_ids]
                return self._pull_encoded(peer, request, self._pool_codec, blocks,
                                          deadline, what)
            chunks = list(chunk_views(self._kv, self._layout, [(d, 1) for d in dst_block_ids]))
            return self._receive_into(peer, request, chunks, deadline, what,
                                      len(dst_block_ids))
        finally:
            self._count(inflight_pulls=-1)

    def _pull_encoded(self, peer: PeerAddress, request: dict[str, Any], codec: PoolCodec,
                      blocks: list[list[torch.Tensor]], deadline: float, what: str) -> int:
        start = time.perf_counter_ns()
        checksum = self.options.checksum

        def exchange(conn: socket.socket) -> int:
            send_msg(conn, {**request, "checksum": checksum})
            return codec.receive(conn, blocks, checksum, deadline, what,
                                 self.options.stall_s).nbytes

        try:
            received = self._control(peer, deadline, what, exchange)
        except TransferError as exc:
            self._count(transfers_failed=1,
                        checksum_failures=int(isinstance(exc, PoolChecksumError)))
            raise
        self._count(bytes_received=received, transfers_completed=1,
                    transfer_time_ns=time.perf_counter_ns() - start)
        return received
