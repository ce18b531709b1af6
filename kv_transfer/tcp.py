"""TCP transport: KV bytes go raw over the control connection, straight from and
into the registered KV tensors (``sendall``/``recv_into`` on views; no pickling,
no staging copy for host memory; device memory is staged through host memory).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from .base import PeerAddress
from .control import ControlledTransport
from .layout import as_bytes
from .wire import recv_into_exact, set_deadline


class TcpTransport(ControlledTransport):
    name: ClassVar[str] = "tcp"
    inline_data: ClassVar[bool] = True

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
