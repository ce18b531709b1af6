"""TCP transport: KV bytes go raw over the control connection, straight from and
into the registered KV tensors (``sendall``/``recv_into`` on views; no pickling,
no staging copy for host memory). Device memory crosses host memory in pieces
through two pinned buffers, so the device copy of one piece overlaps the socket
transfer of the next.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.base import PeerAddress, PushChannel, TransportOptions
from pdserve.kv_transfer.coded_pull import CodedPullTransport
from pdserve.kv_transfer.control.channel import Handler
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_into_exact,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.layout import as_bytes
from pdserve.kv_transfer.push.inbox import PushInbox
from pdserve.kv_transfer.push.wire import layer_chunks, send_push, serve_push, serve_push_abort

# Device memory is staged through host memory in pieces of at most this many bytes.
STAGE_BYTES = 4 << 20


class TcpTransport(CodedPullTransport):
    """KV pulled and pushed as raw bytes over the control connection."""

    name: ClassVar[str] = "tcp"
    inline_data: ClassVar[bool] = True

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        # Where pushed KV lands on a decode worker (None: pushes are refused).
        self._inbox: PushInbox | None = None

    # ---- layer-wise push (see push/wire.py) ----------------------------------------

    def push_channel(self) -> PushChannel:
        return self

    def accept_pushes(self, inbox: PushInbox) -> None:
        self._inbox = inbox

    def _extra_ops(self) -> dict[str, Handler]:
        return {"push": self._on_push,
                "push_abort": lambda conn, msg: serve_push_abort(conn, msg, self._inbox)}

    def _on_push(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        self._count(bytes_received=serve_push(conn, msg, self._inbox))

    def push(
        self, peer: PeerAddress, transfer_id: str, layer: int, first_position: int,
        block_ids: Sequence[int], num_blocks: int, final: bool, deadline: float,
        checksum: bool = False,
    ) -> int:
        if self._layout is None:
            raise TransferError("push before the transport was started")
        chunks = layer_chunks(self._kv[layer], self._layout.layers[layer], block_ids)
        header = {"xfer": transfer_id, "layer": layer, "first": first_position,
                  "count": len(block_ids), "num_blocks": num_blocks, "final": final}
        sent = self._control(peer, deadline, f"push of {transfer_id} to {peer}",
                             lambda conn: send_push(conn, header, chunks, checksum))
        self._count(bytes_sent=sent)
        return sent

    def push_abort(self, peer: PeerAddress, transfer_id: str, why: str, deadline: float) -> None:
        what = f"push abort of {transfer_id} to {peer}"

        def abort(conn: socket.socket) -> int:
            send_msg(conn, {"op": "push_abort", "xfer": transfer_id, "why": why})
            check_reply(recv_msg(conn), what)
            return 0

        self._control(peer, deadline, what, abort)

    # ---- pull data path ------------------------------------------------------------

    def _send_blocks(self, conn: socket.socket, msg: dict[str, Any],
                     chunks: Sequence[torch.Tensor], first_index: int, deadline: float) -> int:
        if chunks and chunks[0].device.type != "cpu":
            return _send_device(conn, chunks, deadline)
        sent = 0
        for chunk in chunks:
            set_deadline(conn, deadline)
            view = as_bytes(chunk)
            conn.sendall(view)
            sent += len(view)
        return sent

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> _SocketReceive:
        return _SocketReceive(chunks, self.options.stall_s)


class _SocketReceive:
    """Reads the pull's bytes off the control connection into the chunks."""

    def __init__(self, chunks: Sequence[torch.Tensor], stall_s: float | None) -> None:
        self.fields: dict[str, Any] = {}
        self._chunks = chunks
        self._stall_s = stall_s

    def receive(self, conn: socket.socket, deadline: float) -> int:
        if self._chunks and self._chunks[0].device.type != "cpu":
            return _recv_device(conn, self._chunks, deadline, self._stall_s)
        received = 0
        for chunk in self._chunks:
            set_deadline(conn, deadline, self._stall_s)
            view = as_bytes(chunk)
            recv_into_exact(conn, view)
            received += len(view)
        return received

    def abort(self) -> None:
        return  # the caller closes the connection: nothing else can write


# ---- device memory, staged through two pinned buffers ----------------------------

def _pieces(chunks: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The chunks' bytes in wire order as pieces of at most ``STAGE_BYTES``: each a
    list of flat uint8 device views (small chunks share a piece, large ones are cut)."""
    pieces: list[list[torch.Tensor]] = []
    piece: list[torch.Tensor] = []
    size = 0
    for chunk in chunks:
        if not chunk.is_contiguous():
            raise ValueError("KV chunk is not contiguous")
        flat = chunk.view(-1).view(torch.uint8)
        off = 0
        while off < flat.numel():
            n = min(STAGE_BYTES - size, flat.numel() - off)
            piece.append(flat[off:off + n])
            size, off = size + n, off + n
            if size == STAGE_BYTES:
                pieces.append(piece)
                piece, size = [], 0
    if piece:
        pieces.append(piece)
    return pieces


def _staging(pieces: list[list[torch.Tensor]]) -> tuple[torch.cuda.Stream, list[torch.Tensor]]:
    """A side stream ordered after the work already queued on the device's current
    stream (whatever wrote, or last read, the blocks), and two pinned buffers."""
    device = pieces[0][0].device
    stream = torch.cuda.Stream(device=device)
    stream.wait_stream(torch.cuda.current_stream(device))
    size = max(sum(v.numel() for v in piece) for piece in pieces)
    return stream, [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]


def _copy(piece: list[torch.Tensor], buf: torch.Tensor, to_device: bool) -> int:
    """Queue the copies between a piece's views and ``buf`` (on the current stream)."""
    pos = 0
    for view in piece:
        n = view.numel()
        if to_device:
            view.copy_(buf[pos:pos + n], non_blocking=True)
        else:
            buf[pos:pos + n].copy_(view, non_blocking=True)
        pos += n
    return pos


def _send_device(conn: socket.socket, chunks: Sequence[torch.Tensor], deadline: float) -> int:
    pieces = _pieces(chunks)
    if not pieces:
        return 0
    stream, bufs = _staging(pieces)
    copied = [torch.cuda.Event(), torch.cuda.Event()]
    sizes = [0, 0]

    def stage(i: int) -> None:  # buffer i % 2 is free: its previous piece was sent
        with torch.cuda.stream(stream):
            sizes[i % 2] = _copy(pieces[i], bufs[i % 2], to_device=False)
            copied[i % 2].record(stream)

    stage(0)
    sent = 0
    for i in range(len(pieces)):
        if i + 1 < len(pieces):
            stage(i + 1)
        copied[i % 2].synchronize()
        set_deadline(conn, deadline)
        view = as_bytes(bufs[i % 2][:sizes[i % 2]])
        conn.sendall(view)
        sent += len(view)
    return sent


def _recv_device(conn: socket.socket, chunks: Sequence[torch.Tensor], deadline: float,
                 stall_s: float | None = None) -> int:
    pieces = _pieces(chunks)
    if not pieces:
        return 0
    stream, bufs = _staging(pieces)
    copied: list[torch.cuda.Event | None] = [None, None]
    received = 0
    try:
        for i, piece in enumerate(pieces):
            if (event := copied[i % 2]) is not None:
                event.synchronize()  # the buffer's previous piece is on the device
            buf = bufs[i % 2][:sum(v.numel() for v in piece)]
            set_deadline(conn, deadline, stall_s)
            recv_into_exact(conn, as_bytes(buf))
            with torch.cuda.stream(stream):
                received += _copy(piece, buf, to_device=True)
                copied[i % 2] = event = torch.cuda.Event()
                event.record(stream)
    finally:
        stream.synchronize()  # nothing writes into the blocks once we return
    return received
