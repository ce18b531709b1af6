"""The KV control port's accept loop (``kv_transfer/control/server.py``): connections
past ``max_connections`` are closed at once and counted as refusals, while a real pull
still works once the held ones are gone; a thread that cannot start (``RuntimeError``
from ``Thread.start``) costs its connection, never the accept loop."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import torch
from pdserve_testing import make_caches, start_transport, wait_until

from pdserve.core.cluster_secret import ClusterSecret, num_refusals
from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.leases import LeaseTable

SRC, DST = [1, 2, 3], [4, 5, 6]
CAP = 4


@pytest.fixture
def sender() -> Iterator[tuple[KVTransport, int, dict[str, torch.Tensor]]]:
    """A tcp sender serving at most ``CAP`` connections, holding a lease for ``r``."""
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport("tcp", caches, leases,
                                      TransportOptions(max_connections=CAP))
    yield transport, port, caches
    transport.close()


def _pull(port: int) -> dict[str, torch.Tensor]:
    caches = make_caches(2, torch.float32)
    receiver, _ = start_transport("tcp", caches, LeaseTable())
    try:
        receiver.pull(PeerAddress("127.0.0.1", port), "r", SRC, DST, time.monotonic() + 20)
    finally:
        receiver.close()
    return caches


def _moved(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(src[k][SRC], dst[k][DST]) for k in src)


def _closed_by_server(sock: socket.socket, timeout_s: float = 5.0) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``timeout_s``; False
    when it is still held open (the read times out)."""
    sock.settimeout(timeout_s)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _status_answers(port: int) -> bool:
    try:
        return bool(request_once("127.0.0.1", port, {"op": "status"}, 2.0)["ok"])
    except TransferError:
        return False


def test_connections_past_the_cap_are_refused_and_a_pull_works_after(sender: tuple) -> None:
    _, port, caches = sender
    before = num_refusals("kv", "too many connections")
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP)]
    try:
        # Each held connection has its thread (it is waiting for a first message).
        assert _status_answers(port) is False  # no slot: a fresh connection is closed
        extra = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
        assert all(_closed_by_server(s) for s in extra)
        for s in extra:
            s.close()
        assert not _closed_by_server(held[0], timeout_s=0.5)  # still served
        assert num_refusals("kv", "too many connections") - before >= 4
    finally:
        for s in held:
            s.close()
    wait_until(lambda: _status_answers(port), 10)
    assert _moved(caches, _pull(port))


def test_a_thread_that_cannot_start_does_not_end_the_accept_loop(
        sender: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    _, port, caches = sender
    original = threading.Thread.start
    failures: list[str] = []

    def start_once_failing(self: threading.Thread) -> None:
        if self.name == "pdserve-kv-conn" and not failures:
            failures.append(self.name)
            raise RuntimeError("can't start new thread")
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start_once_failing)
    with socket.create_connection(("127.0.0.1", port)) as victim:
        assert _closed_by_server(victim)  # its connection is closed, not left hanging
    assert failures == ["pdserve-kv-conn"]
    assert _moved(caches, _pull(port))  # the loop accepted the next connections
    # The failed start gave its slot back: CAP connections are still served at once.
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(CAP - 1)]
    try:
        wait_until(lambda: _status_answers(port), 10)
    finally:
        for s in held:
            s.close()


def test_strangers_that_never_log_in_cannot_starve_a_peer_with_the_secret() -> None:
    """With a secret, connections still logging in are capped (``max_logins``): each
    one past it ends the oldest, so a flood of silent connections holds no slot for
    long, and a peer that authenticates in a round trip still pulls."""
    secret = ClusterSecret(b"k" * 32)
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    sender, port = start_transport("tcp", caches, leases, TransportOptions(
        secret=secret, max_connections=64, max_logins=CAP))
    before = num_refusals("kv", "login evicted")
    silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * CAP)]
    try:
        # The oldest 2 * CAP were ended as newer ones came: they see EOF, long before
        # their 5 s to authenticate is up; the newest CAP are still waiting.
        assert all(_closed_by_server(s, timeout_s=2.0) for s in silent[:2 * CAP])
        assert not _closed_by_server(silent[-1], timeout_s=0.2)
        receiver_caches = make_caches(2, torch.float32)
        receiver, _ = start_transport("tcp", receiver_caches, LeaseTable(),
                                      TransportOptions(secret=secret))
        try:
            receiver.pull(PeerAddress("127.0.0.1", port), "r", SRC, DST,
                          time.monotonic() + 20)
        finally:
            receiver.close()
        assert _moved(caches, receiver_caches)
        assert num_refusals("kv", "login evicted") - before >= 2 * CAP
    finally:
        for s in silent:
            s.close()
        sender.close()
