"""A pull the prefill refuses because it asks for blocks outside the lease ends that
lease *before* the refusal goes out (``kv_transfer/pull.py``), as a served pull ends it
before its trailer: a decode that has the refusal and pulls again is told the lease
ended, never that it is "already being transferred" (which it was, for the moment
between the refusal and the end). Over tcp on loopback, in one process, without vLLM."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pdserve_testing import make_caches, start_transport

from pdserve.kv_transfer import pull
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.leases import LeaseTable


def test_a_refused_pull_ends_the_lease_before_the_refusal_goes_out(
        monkeypatch: pytest.MonkeyPatch) -> None:
    leases = LeaseTable()
    held_at_refusal: list[int] = []
    real_send = pull.send_msg

    def send_msg(conn: Any, msg: dict[str, Any]) -> None:
        if msg.get("ok") is False:
            held_at_refusal.append(leases.num_held)
        real_send(conn, msg)

    monkeypatch.setattr(pull, "send_msg", send_msg)
    server, port = start_transport("tcp", make_caches(1, torch.float32), leases)
    client, _ = start_transport("tcp", make_caches(0, torch.float32), LeaseTable())
    try:
        leases.add("once", [1, 2], time.time() + 60)
        target = PeerAddress("127.0.0.1", port)
        with pytest.raises(TransferError, match="not leased"):
            client.pull(target, "once", [1, 2, 3], [4, 5, 6], time.monotonic() + 10)
        assert held_at_refusal == [0]
        with pytest.raises(TransferError, match="ended"):
            client.pull(target, "once", [1, 2], [4, 5], time.monotonic() + 10)
    finally:
        client.close()
        server.close()
