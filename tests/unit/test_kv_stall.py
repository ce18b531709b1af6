"""``--kv-stall-s``: a KV pull whose peer goes silent (a cut link, a frozen process: no
error reaches the puller) fails once no byte has come for that long, not at the pull's
deadline, so decode recomputes the prompt within seconds."""

from __future__ import annotations

import socket
import time

import pytest
import torch

from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.control.pool import ConnectionPool
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.transports.tcp import _SocketReceive

STALL_S = 0.3
DEADLINE_S = 30.0


def test_a_receive_from_a_silent_peer_fails_at_the_stall_bound() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.sendall(b"\0" * 100)  # some bytes, then silence
        receive = _SocketReceive([torch.zeros(1000, dtype=torch.uint8)], STALL_S)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            receive.receive(ours, time.monotonic() + DEADLINE_S)
        assert time.monotonic() - started < STALL_S * 5


def test_a_receive_that_keeps_coming_is_not_cut_by_the_bound() -> None:
    ours, theirs = socket.socketpair()
    with ours, theirs:
        payload = bytes(range(256)) * 4
        theirs.sendall(payload)
        chunk = torch.zeros(len(payload), dtype=torch.uint8)
        assert _SocketReceive([chunk], STALL_S).receive(
            ours, time.monotonic() + DEADLINE_S) == len(payload)
        assert bytes(chunk.numpy()) == payload


def test_a_peer_that_accepts_and_never_answers_fails_the_handshake_at_the_bound() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:  # the kernel accepts; no reply
        peer = PeerAddress("127.0.0.1", server.getsockname()[1])
        pool = ConnectionPool(60.0, stall_s=STALL_S)
        started = time.monotonic()
        with pytest.raises(TransferError, match="handshake"):
            pool.checkout(peer, time.monotonic() + DEADLINE_S, {})
        assert time.monotonic() - started < STALL_S * 5


def test_a_stall_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stall_s"):
        TransportOptions(stall_s=0)
