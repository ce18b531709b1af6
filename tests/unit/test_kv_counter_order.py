"""A sender's counters are true when its peer learns the outcome (``pull.PullTransport._send``).

The receiver returns as soon as it reads the trailer, so whatever reads the sender's
counters right after a pull (a ``/metrics`` scrape, ``GetLoad``, a test) must find the
transfer counted. The sender here is made slow *after* each trailer leaves (a real
machine under load is slow at random there): a sender that counted after the trailer
shows 0 to a reader that looks at once, on every pull.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pdserve_testing import make_caches, start_transport
from unit.test_kv_pool import TRANSPORTS, _Pair
from unit.test_kv_tiers import _h

from pdserve.kv_transfer import pull as pull_module
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.leases import LeaseTable

NUM_PULLS = 20
SRC, DST = [1, 2, 3], [4, 5, 6]


def _is_trailer(msg: dict[str, Any]) -> bool:
    return "bytes" in msg or str(msg.get("error", "")).startswith(("blocks rewritten",
                                                                    "send failed"))


@pytest.fixture
def slow_after_trailer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender stalls 50 ms right after a trailer is on the wire."""
    real = pull_module.send_msg

    def send_msg(conn: Any, msg: dict[str, Any]) -> None:
        real(conn, msg)
        if _is_trailer(msg):
            time.sleep(0.05)

    monkeypatch.setattr(pull_module, "send_msg", send_msg)


@pytest.fixture(params=TRANSPORTS)
def name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def sender(name: str) -> Iterator[tuple[Any, int, LeaseTable]]:
    leases = LeaseTable()
    transport, port = start_transport(name, make_caches(1, torch.float32), leases)
    yield transport, port, leases
    transport.close()


@pytest.mark.usefixtures("slow_after_trailer")
def test_the_sender_has_counted_a_pull_when_the_receiver_returns(
        name: str, sender: tuple[Any, int, LeaseTable]) -> None:
    transport, port, leases = sender
    receiver, _ = start_transport(name, make_caches(2, torch.float32), LeaseTable())
    try:
        for i in range(NUM_PULLS):
            leases.add(f"r{i}", SRC, time.time() + 60)
            nbytes = receiver.pull(PeerAddress("127.0.0.1", port), f"r{i}", SRC, DST,
                                   time.monotonic() + 20)
            stats = transport.stats()  # at once: no wait_until
            assert stats["transfers_completed"] == i + 1, f"pull {i}: {stats}"
            assert stats["bytes_sent"] == (i + 1) * nbytes
            assert leases.num_held == 0
    finally:
        receiver.close()


@pytest.mark.usefixtures("slow_after_trailer")
def test_a_failed_pool_pull_is_counted_when_the_puller_sees_the_failure(name: str) -> None:
    pair = _Pair(name)
    try:
        real = pair.store.serve
        for i in range(3):
            pair.save([3], [0], [_h(3)])

            def rewritten(hashes: list[bytes]) -> Any:
                serve = real(hashes)
                pair.save([5], [0], [_h(5)])  # the slot changes before the trailer
                return serve

            pair.server.serve_pool(rewritten)
            with pytest.raises(TransferError, match="rewritten"):
                pair.client.pull_pool(pair.peer, [_h(3)], [6], time.monotonic() + 10)
            assert pair.store.stats()["pool_serve_failures"] == i + 1
            assert pair.server.stats()["transfers_failed"] == i + 1
        pair.save([3], [0], [_h(3)])
        pair.server.serve_pool(real)
        pair.client.pull_pool(pair.peer, [_h(3)], [6], time.monotonic() + 10)
        assert pair.store.stats()["pool_serves"] == 1
        assert pair.server.stats()["transfers_completed"] == 1
    finally:
        pair.close()
