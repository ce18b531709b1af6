"""The lease table, the transport registry and flags, and control ops (no vLLM).

Transfers between processes, per transport, are in test_kv_transports.py."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from pdserve_testing import make_caches, start_transport, wait_until

from pdserve.kv_transfer.base import (
    PeerAddress,
    TransportOptions,
    create_transport,
    transport_names,
)
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.integrity import checksum
from pdserve.kv_transfer.leases import LeaseError, LeaseTable


def test_release_and_status_without_transfer() -> None:
    table = LeaseTable()
    for req, block in (("r1", 1), ("r2", 2)):
        table.add(req, [block], time.time() + 30)
    transport, port = start_transport("tcp", make_caches(1, torch.float32), table)
    assert request_once("127.0.0.1", port, {"op": "status"}, 5)["num_leases"] == 2
    assert request_once("127.0.0.1", port, {"op": "release", "req": "r1"}, 10)["found"]
    assert request_once("127.0.0.1", port, {"op": "status"}, 5)["num_leases"] == 1
    assert table.take_done() == {"r1"}
    transport.close()


def test_a_peer_restarted_on_its_address_gets_the_next_release() -> None:
    """A pooled control connection to a peer that died is not reused: the release after
    the peer's restart (same port) reaches the new one, not a dead socket (seen: a
    prefill worker SIGKILLed and restarted kept a decode's release from arriving, so its
    lease held the blocks until expiry)."""
    old_leases, new_leases = LeaseTable(), LeaseTable()
    old_leases.add("r1", [1], time.time() + 30)
    new_leases.add("r2", [2], time.time() + 30)
    caches = make_caches(1, torch.float32)
    client, _ = start_transport("tcp", caches, LeaseTable())
    old, port = start_transport("tcp", caches, old_leases)
    peer = PeerAddress("127.0.0.1", port)
    client.release(peer, "r1", time.monotonic() + 5)  # leaves a pooled connection
    assert old_leases.take_done() == {"r1"}
    old.close()  # its accept thread lets go of the port within its poll interval
    new = wait_until(lambda: _start_on(caches, new_leases, port), 5.0, interval_s=0.05)
    assert new, f"port {port} never came free"
    try:
        client.release(peer, "r2", time.monotonic() + 5)
        assert new_leases.take_done() == {"r2"}
    finally:
        new.close()
        client.close()


def _start_on(caches: dict[str, torch.Tensor], leases: LeaseTable, port: int) -> Any:
    try:
        return start_transport("tcp", caches, leases, port=port)[0]
    except OSError:
        return None


@pytest.mark.parametrize("name", ["tcp", "ucx", "torch"])
def test_unreachable_peer_errors_within_deadline(name: str) -> None:
    transport, _ = start_transport(name, make_caches(0, torch.float32), LeaseTable())
    started = time.monotonic()
    with pytest.raises(TransferError):
        transport.pull(PeerAddress("127.0.0.1", 1), "r", [1], [1], started + 2)
    # The pull's 2 s deadline (or the refusal) ended it, not a transport's own far longer
    # connect wait (torch.distributed's group setup allows 30 s).
    assert time.monotonic() - started < 15
    transport.close()


def test_unknown_transport_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid transports: tcp, torch, ucx"):
        create_transport("carrier-pigeon")
    assert transport_names() == ["tcp", "torch", "ucx"]
    with pytest.raises(ValueError, match="valid transports: tcp, torch, ucx"):
        ConnectorConfig(engine_id="e", transport="nccl")


def test_cli_transport_choices_and_flags() -> None:
    from pdserve.cli.parser import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefill", "--transport", "carrier-pigeon"])
    args = build_parser().parse_args(["decode", "--transport", "ucx", "--kv-checksum",
                                      "--kv-throttle-mib-s", "8", "--kv-stall-s", "2.5"])
    assert (args.transport, args.kv_checksum, args.kv_throttle_mib_s, args.kv_stall_s) == (
        "ucx", True, 8.0, 2.5)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["decode", "--kv-stall-s", "0"])
    options = ConnectorConfig(engine_id="e", transport="torch", kv_checksum=True,
                              kv_throttle_mib_s=8, kv_stall_s=2.5).transport_options()
    assert options == TransportOptions(checksum=True, throttle_bytes_per_s=8 * 2**20,
                                       stall_s=2.5)


def test_lease_expiry_and_late_pull() -> None:
    now = [1000.0]
    table = LeaseTable(clock=lambda: now[0])
    table.add("a", [1, 2], deadline=1010.0)
    table.add("b", [3], deadline=1100.0)
    now[0] = 1020.0
    assert table.expire() == 1
    assert table.take_done() == {"a"}
    with pytest.raises(LeaseError, match="expired"):
        table.checkout("a", wait_s=0.1)
    assert table.checkout("b", wait_s=0.1) == (3,)
    now[0] = 2000.0
    assert table.expire() == 0  # in transfer: not expired under the reader
    table.finish("b")
    assert table.take_done() == {"b"}
    assert table.num_held == 0


def test_release_before_lease_arrives_frees_it_on_arrival() -> None:
    table = LeaseTable()
    assert not table.wait_and_finish("x", wait_s=0.05, why="released")
    table.add("x", [5], deadline=time.time() + 30)
    assert table.take_done() == {"x"}
    assert table.num_held == 0


@pytest.mark.parametrize("kind", ["crc32", "wsum64"])
def test_checksum_sees_any_flipped_bit_and_is_deterministic(kind: str) -> None:
    chunks = [t for t in make_caches(3, torch.bfloat16).values()]
    value = checksum(chunks, kind)
    assert value == checksum([c.clone() for c in chunks], kind)
    for layer, byte, bit in ((0, 0, 0), (3, 12345, 7), (2, -1, 3)):
        bad = [c.clone() for c in chunks]
        bad[layer].view(torch.uint8).view(-1)[byte] ^= 1 << bit
        assert checksum(bad, kind) != value
    with pytest.raises(ValueError, match="valid kinds: crc32, wsum64"):
        checksum(chunks, "md5")
