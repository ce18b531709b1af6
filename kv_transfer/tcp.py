"""TCP transport: KV bytes go raw over the control connection, straight from and
into the registered KV tensors (``sendall``/``recv_into`` on views; no pickling,
no staging copy for host memory; device memory is staged through host memory).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .base import PeerAddress, PushChannel, TransportOptions
from .control import Handler
from .layout import as_bytes
from .pull import PullTransport
from .push_inbox import PushInbox
from .push_wire import layer_chunks, send_push, serve_push, serve_push_abort
from .wire import TransferError, check_reply, recv_into_exact, recv_msg, send_msg, set_deadline


class TcpTransport(PullTransport):
    """KV pulled and pushed as raw bytes over the control connection."""

    name: ClassVar[str] = "tcp"
    inline_data: ClassVar[bool] = True

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        # Where pushed KV lands on a decode worker (None: pushes are refused).
        self._inbox: PushInbox | None = None

    # ---- layer-wise push (see push_wire.py) ----------------------------------------

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
        sent = 0
        for chunk in chunks:
            set_deadline(conn, deadline)
            host = chunk if chunk.device.type == "cpu" else chunk.to("cpu")
            view = as_bytes(host)
            conn.sendall(view)
            sent += len(view)
        return sent

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> _SocketReceive:
        return _SocketReceive(chunks)


class _SocketReceive:
    """Reads the pull's bytes off the control connection into the chunks."""

    def __init__(self, chunks: Sequence[torch.Tensor]) -> None:
        self.fields: dict[str, Any] = {}
        self._chunks = chunks

    def receive(self, conn: socket.socket, deadline: float) -> int:
        received = 0
        for chunk in self._chunks:
            set_deadline(conn, deadline)
            received += _recv_chunk(conn, chunk)
        return received

    def abort(self) -> None:
        return  # the caller closes the connection: nothing else can write


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
