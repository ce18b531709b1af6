"""Every KV transport (tcp, ucx, torch/gloo) between two real processes, without vLLM.

One peer process per transport serves every (block dim, dtype) KV set and is
shared by the tests of that transport; the pulling side runs in this process.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pdserve_testing import (
    CORRUPT_KEY,
    KV_KEYS,
    NUM_BLOCKS,
    KVPeer,
    kv_seed,
    make_caches,
    start_transport,
    wait_until,
)

from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions
from pdserve.kv_transfer.control.wire import IncompatiblePeerError, TransferError
from pdserve.kv_transfer.leases import LeaseTable

TRANSPORTS = ["tcp", "ucx", "torch"]
Key = tuple[int, str]
_reqs = iter(range(10**9))


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(scope="module")
def peer(transport_name: str) -> Iterator[KVPeer]:
    server = KVPeer(transport_name)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def clients(transport_name: str) -> Iterator[dict[Key, tuple[KVTransport, dict[str, Any]]]]:
    made = {}
    for block_dim, dtype_name in KV_KEYS:
        caches = make_caches(0, getattr(torch, dtype_name), block_dim=block_dim)
        transport, _ = start_transport(transport_name, caches, LeaseTable(),
                                       TransportOptions(checksum=True))
        made[(block_dim, dtype_name)] = (transport, caches)
    yield made
    for transport, _ in made.values():
        transport.close()


def _block(tensor: torch.Tensor, block_dim: int, block: int) -> torch.Tensor:
    return (tensor[block] if block_dim == 0 else tensor[:, block]).view(torch.uint8)


@st.composite
def transfers(draw: st.DrawFn) -> tuple[Key, list[int], list[int]]:
    key = draw(st.sampled_from(KV_KEYS))
    blocks = st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=1, max_size=NUM_BLOCKS,
                      unique=True)
    src = draw(blocks)
    dst = draw(st.permutations(range(NUM_BLOCKS)))[: len(src)]
    return key, src, dst


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=transfers())
def test_pull_moves_random_blocks_bit_exact(peer: KVPeer, clients: dict, case: tuple) -> None:
    key, src, dst = case
    block_dim, dtype_name = key
    transport, caches = clients[key]
    for tensor in caches.values():
        tensor.fill_(0)
    req = f"r{next(_reqs)}"
    peer.lease(key, req, src + [b for b in range(2) if b not in src])
    nbytes = transport.pull(PeerAddress("127.0.0.1", peer.ports[key]), req, src, dst,
                            time.monotonic() + 30)
    want = make_caches(kv_seed(block_dim, dtype_name), getattr(torch, dtype_name),
                       block_dim=block_dim)
    block_bytes = _block(want["layer.0"], block_dim, 0).numel()
    assert nbytes == len(src) * len(want) * block_bytes
    for name, tensor in caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(_block(tensor, block_dim, d), _block(want[name], block_dim, s))
        for b in set(range(NUM_BLOCKS)) - set(dst):
            assert not _block(tensor, block_dim, b).any(), "a block outside dst was written"
    # the pull ended the lease (the server ends it just after sending the trailer)
    assert wait_until(lambda: peer.status(key)["num_held"] == 0, 5, 0.02)


def test_second_pull_and_unknown_lease_are_refused(peer: KVPeer, clients: dict) -> None:
    key = (0, "float32")
    transport, _ = clients[key]
    target = PeerAddress("127.0.0.1", peer.ports[key])
    peer.lease(key, "once", [1, 2])
    with pytest.raises(TransferError, match="not leased"):
        transport.pull(target, "once", [1, 2, 3], [4, 5, 6], time.monotonic() + 10)
    with pytest.raises(TransferError, match="ended"):  # a refused pull still ends the lease
        transport.pull(target, "once", [1, 2], [4, 5], time.monotonic() + 10)
    started = time.monotonic()
    with pytest.raises(TransferError, match="no KV lease"):
        transport.pull(target, "never", [1], [4], started + 60)
    # Ended by the server's 5 s wait for the lease, not by the pull's 60 s deadline.
    assert time.monotonic() - started < 30
    peer.lease(key, "after", [3])  # and the transport still works afterwards
    transport.pull(target, "after", [3], [7], time.monotonic() + 10)


@pytest.mark.parametrize(("client_key", "field"), [((0, "bfloat16"), "dtype"),
                                                   ((1, "float32"), "block_dim")])
def test_incompatible_peer_is_refused_naming_both_sides(
    peer: KVPeer, clients: dict, client_key: Key, field: str
) -> None:
    transport, _ = clients[client_key]
    server_key = (0, "float32")
    peer.lease(server_key, "incompat", [1])
    with pytest.raises(IncompatiblePeerError) as info:
        transport.pull(PeerAddress("127.0.0.1", peer.ports[server_key]), "incompat", [1], [2],
                       time.monotonic() + 10)
    message = str(info.value)
    assert f"{field}" in message and "server=" in message and "client=" in message
    if field == "dtype":
        assert "server='torch.float32' client='torch.bfloat16'" in message


def test_other_transport_is_refused(peer: KVPeer, transport_name: str) -> None:
    other = "tcp" if transport_name != "tcp" else "torch"
    caches = make_caches(0, torch.float32)
    transport, _ = start_transport(other, caches, LeaseTable())
    try:
        with pytest.raises(IncompatiblePeerError,
                           match=f"transport: server='{transport_name}' client='{other}'"):
            transport.pull(PeerAddress("127.0.0.1", peer.ports[(0, "float32")]), "x", [1], [2],
                           time.monotonic() + 10)
    finally:
        transport.close()


def test_checksum_catches_corruption_in_flight(peer: KVPeer, transport_name: str) -> None:
    target = PeerAddress("127.0.0.1", peer.ports[CORRUPT_KEY])
    for checked in (True, False):
        caches = make_caches(0, torch.float32)
        transport, _ = start_transport(transport_name, caches, LeaseTable(),
                                       TransportOptions(checksum=checked))
        req = f"corrupt-{checked}"
        peer.lease(CORRUPT_KEY, req, [1, 2])
        try:
            if checked:
                with pytest.raises(TransferError, match="checksum mismatch"):
                    transport.pull(target, req, [1, 2], [3, 4], time.monotonic() + 10)
                assert transport.stats()["checksum_failures"] == 1
            else:  # the same corruption goes unnoticed without the checksum
                transport.pull(target, req, [1, 2], [3, 4], time.monotonic() + 10)
                want = make_caches(kv_seed(0, "float32"), torch.float32)
                assert not torch.equal(caches["layer.0"][3], want["layer.0"][1])
                assert torch.equal(caches["layer.1"][3], want["layer.1"][1])
        finally:
            transport.close()
        assert wait_until(lambda: peer.status(CORRUPT_KEY)["num_held"] == 0, 5, 0.02)


def test_a_pull_of_a_mebibyte_or_more_measures_its_path(peer: KVPeer, clients: dict) -> None:
    """The puller records the path's rate per peer (``kv_transfer/links.py``): what a
    token's KV weighs on the wire, exactly, and a positive rate; a small pull is no
    sample (round trips, not the link)."""
    key = (0, "float32")
    transport, caches = clients[key]
    target = PeerAddress("127.0.0.1", peer.ports[key])
    name = f"127.0.0.1:{peer.ports[key]}"

    def samples() -> int:
        return sum(int(e["samples"]) for e in transport.links.status() if e["peer"] == name)

    before = samples()
    peer.lease(key, "small", [1])
    transport.pull(target, "small", [1], [1], time.monotonic() + 30)
    assert samples() == before
    every = list(range(NUM_BLOCKS))  # 16 blocks of 96 KiB: 1.5 MiB
    peer.lease(key, "large", every)
    nbytes = transport.pull(target, "large", every, every, time.monotonic() + 30)
    assert samples() == before + 1
    (link,) = [e for e in transport.links.status() if e["peer"] == name]
    assert link["bytes_per_token"] == nbytes / (NUM_BLOCKS * 16)  # block size 16
    assert float(link["bytes_per_s"]) > 0 and float(link["age_s"]) < 30
