"""A KV peer killed with SIGKILL mid-transfer, per transport, in both directions.

The sender is throttled (``TransportOptions.throttle_bytes_per_s``, the documented
``--kv-throttle-mib-s``) so a 1.5 MiB transfer takes ~1.5 s, and the kill lands
while the status op reports a send in progress.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from typing import Any

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, KVPeer, make_caches, pull_main, start_transport, wait_until

from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.leases import LeaseTable

TRANSPORTS = ["tcp", "ucx", "torch"]
KEY = (0, "float32")
ALL = list(range(NUM_BLOCKS))
SLOW = TransportOptions(throttle_bytes_per_s=1 << 20)
DEADLINE_S = 30.0


def _sending(port: int) -> bool:
    return bool(request_once("127.0.0.1", port, {"op": "status"}, 5)["num_sending"])


@pytest.mark.parametrize("name", TRANSPORTS)
def test_sender_killed_mid_transfer_fails_the_pull_early(name: str) -> None:
    peer = KVPeer(name, {"throttle_bytes_per_s": SLOW.throttle_bytes_per_s})
    caches = make_caches(0, torch.float32)
    transport, _ = start_transport(name, caches, LeaseTable())
    outcome: dict[str, Any] = {}

    def pull() -> None:
        started = time.monotonic()
        try:
            transport.pull(PeerAddress("127.0.0.1", peer.ports[KEY]), "victim", ALL, ALL,
                           started + DEADLINE_S)
            outcome["result"] = "completed"
        except TransferError as exc:
            outcome["result"] = exc
        outcome["ended"] = time.monotonic()

    peer.lease(KEY, "victim", ALL)
    puller = threading.Thread(target=pull)
    try:
        puller.start()
        assert wait_until(lambda: _sending(peer.ports[KEY]), timeout_s=20, interval_s=0.05)
        peer.proc.kill()
        killed = time.monotonic()
        puller.join(DEADLINE_S + 5)
        assert not puller.is_alive(), "the pull hung past its deadline"
        assert isinstance(outcome["result"], TransferError), outcome
        noticed = outcome["ended"] - killed  # from the kill: the setup's time is not counted
        # The dead sender's closed socket ended it, well before the pull's deadline would.
        assert noticed < DEADLINE_S / 2, f"noticed the dead sender {noticed:.1f} s after the kill"
        stats = transport.stats()
        assert stats["transfers_failed"] == 1 and stats["inflight_pulls"] == 0
    finally:
        transport.close()
        peer.stop()


@pytest.mark.parametrize("name", TRANSPORTS)
def test_receiver_killed_mid_transfer_ends_the_lease(name: str) -> None:
    table = LeaseTable()
    table.add("victim", ALL, time.time() + 60)
    table.add("next", [1, 2], time.time() + 60)
    sender, port = start_transport(name, make_caches(5, torch.float32), table, SLOW)
    ctx = mp.get_context("spawn")
    result = ctx.Queue()
    receiver = ctx.Process(target=pull_main, daemon=True,
                           args=(name, port, KEY, "victim", ALL, ALL, DEADLINE_S, result))
    try:
        receiver.start()
        assert wait_until(lambda: _sending(port), timeout_s=60, interval_s=0.05)
        receiver.kill()
        # The dead receiver's closed socket ended it, well before the pull's deadline would.
        assert wait_until(lambda: table.num_held == 1, timeout_s=DEADLINE_S / 2), \
            "lease still held"
        assert "victim" in table.take_done()  # the scheduler frees its blocks next step
        assert wait_until(lambda: sender.stats()["transfers_failed"] == 1, timeout_s=5)
        assert not _sending(port)
        # The sender serves the next decode as before.
        caches = make_caches(0, torch.float32)
        client, _ = start_transport(name, caches, LeaseTable())
        try:
            client.pull(PeerAddress("127.0.0.1", port), "next", [1, 2], [3, 4],
                        time.monotonic() + DEADLINE_S)
        finally:
            client.close()
        assert torch.equal(caches["layer.2"][4], make_caches(5, torch.float32)["layer.2"][2])
    finally:
        receiver.join(5)
        if receiver.is_alive():
            receiver.kill()
        sender.close()
