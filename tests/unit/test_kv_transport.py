"""The TCP transport and lease table between two real processes, without vLLM."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch
from pdserve.kv_transfer.base import PeerAddress, create_transport, transport_names
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseError, LeaseTable
from pdserve.kv_transfer.wire import IncompatiblePeerError, TransferError, request_once
from pdserve_testing import NUM_BLOCKS, compat, make_caches, serve_kv


@pytest.fixture
def server():
    ctx = mp.get_context("spawn")
    procs = []

    def start(seed: int, dtype: torch.dtype, leases: dict[str, list[int]]) -> tuple[int, object]:
        ready, stop = ctx.Queue(), ctx.Event()
        proc = ctx.Process(
            target=serve_kv,
            args=(seed, str(dtype).removeprefix("torch."), leases, ready, stop),
            daemon=True,
        )
        proc.start()
        procs.append((proc, stop))
        return ready.get(timeout=60), proc

    yield start
    for proc, stop in procs:
        stop.set()
        proc.join(5)
        if proc.is_alive():
            proc.kill()


def client(dtype: torch.dtype) -> tuple[object, dict[str, torch.Tensor]]:
    caches = {k: torch.zeros_like(v) for k, v in make_caches(0, dtype).items()}
    transport = create_transport("tcp")
    transport.start(
        kv_caches=list(caches.values()),
        layout=KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16),
        leases=LeaseTable(),
        compat=compat(dtype),
        host="127.0.0.1",
        port=0,
    )
    return transport, caches


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pull_is_bit_exact_between_processes(server, dtype: torch.dtype) -> None:
    src = [3, 4, 5, 9, 1]
    dst = [10, 11, 2, 7, 8]
    port, _ = server(seed=7, dtype=dtype, leases={"r1": src + [12]})
    transport, caches = client(dtype)
    nbytes = transport.pull(PeerAddress("127.0.0.1", port), "r1", src, dst, time.monotonic() + 10)
    want = make_caches(7, dtype)
    block_bytes = want["layer.0"][0].numel() * want["layer.0"].element_size()
    assert nbytes == len(src) * len(want) * block_bytes
    for name, tensor in caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(tensor[d].view(torch.uint8), want[name][s].view(torch.uint8))
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not tensor[untouched].any()
    # the lease ended with the pull: a second pull is refused at once
    with pytest.raises(TransferError, match="ended"):
        transport.pull(PeerAddress("127.0.0.1", port), "r1", src, dst, time.monotonic() + 10)
    transport.close()


def test_unknown_lease_and_unleased_blocks_are_refused(server) -> None:
    port, _ = server(seed=1, dtype=torch.float32, leases={"r1": [1, 2]})
    transport, _ = client(torch.float32)
    peer = PeerAddress("127.0.0.1", port)
    with pytest.raises(TransferError, match="not leased"):
        transport.pull(peer, "r1", [1, 2, 3], [4, 5, 6], time.monotonic() + 10)
    start = time.monotonic()
    with pytest.raises(TransferError, match="no KV lease"):
        transport.pull(peer, "nope", [1], [4], time.monotonic() + 30)
    assert time.monotonic() - start < 10  # bounded by the lease wait, not a hang
    transport.close()


def test_incompatible_peer_is_refused_naming_both_sides(server) -> None:
    port, _ = server(seed=1, dtype=torch.float32, leases={"r1": [1]})
    transport, _ = client(torch.bfloat16)
    with pytest.raises(IncompatiblePeerError, match="dtype: local='torch.float32'"):
        transport.pull(PeerAddress("127.0.0.1", port), "r1", [1], [2], time.monotonic() + 10)
    transport.close()


def test_release_and_status_without_transfer(server) -> None:
    port, _ = server(seed=1, dtype=torch.float32, leases={"r1": [1], "r2": [2]})
    assert request_once("127.0.0.1", port, {"op": "status"}, 5)["num_leases"] == 2
    assert request_once("127.0.0.1", port, {"op": "release", "req": "r1"}, 10)["found"]
    assert request_once("127.0.0.1", port, {"op": "status"}, 5)["num_leases"] == 1


def test_dead_peer_errors_within_deadline() -> None:
    transport, _ = client(torch.float32)
    with pytest.raises(TransferError):
        transport.pull(PeerAddress("127.0.0.1", 1), "r", [1], [1], time.monotonic() + 2)
    transport.close()


def test_unknown_transport_lists_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid transports: tcp"):
        create_transport("carrier-pigeon")
    assert "tcp" in transport_names()


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
