"""The GPU paths: KV tensors in device memory over tcp (staged through host memory),
ucx (UCX moves device memory itself) and torch (NCCL, or RCCL on ROCm).

NCCL refuses two ranks on one GPU, so the torch case needs two devices.
"""

from __future__ import annotations

import time

import pytest
import torch
from pdserve_testing import CORRUPT_KEY, KVPeer, kv_seed, make_caches, start_transport

from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.leases import LeaseTable

pytestmark = pytest.mark.gpu  # skipped where there is no device (tests/conftest.py)


def _devices(name: str) -> tuple[str, str]:
    if name != "torch":
        return "cuda:0", "cuda:0"
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a second GPU for a second rank")
    return "cuda:0", "cuda:1"


@pytest.mark.parametrize("name", ["tcp", "ucx", "torch"])
@pytest.mark.parametrize(("block_dim", "dtype_name"), [(1, "bfloat16"), (0, "float32")])
def test_device_kv_moves_bit_exact_and_checksummed(name: str, block_dim: int,
                                                   dtype_name: str) -> None:
    server_dev, client_dev = _devices(name)
    torch.cuda.set_device(client_dev)
    peer = KVPeer(name, device=server_dev)
    dtype = getattr(torch, dtype_name)
    caches = {k: torch.zeros_like(v) for k, v in
              make_caches(0, dtype, block_dim=block_dim, device=client_dev).items()}
    transport, _ = start_transport(name, caches, LeaseTable(), TransportOptions(checksum=True))
    try:
        key = (block_dim, dtype_name)
        src, dst = [3, 4, 9, 1], [10, 11, 2, 7]
        peer.lease(key, "g1", src)
        transport.pull(PeerAddress("127.0.0.1", peer.ports[key]), "g1", src, dst,
                       time.monotonic() + 60)
        want = make_caches(kv_seed(block_dim, dtype_name), dtype, block_dim=block_dim)
        for name_, tensor in caches.items():
            got = tensor.cpu()
            for s, d in zip(src, dst, strict=True):
                pick = (lambda t, b: t[b]) if block_dim == 0 else (lambda t, b: t[:, b])
                assert torch.equal(pick(got, d).view(torch.uint8),
                                   pick(want[name_], s).view(torch.uint8))
        if key == CORRUPT_KEY[:2]:
            peer.lease(CORRUPT_KEY, "g2", [1])
            with pytest.raises(TransferError, match="checksum mismatch"):
                transport.pull(PeerAddress("127.0.0.1", peer.ports[CORRUPT_KEY]), "g2", [1],
                               [2], time.monotonic() + 60)
    finally:
        transport.close()
        peer.stop()


def test_tcp_stages_device_kv_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """tcp stages device memory through pinned buffers in pieces: chunks larger than a
    piece, cut mid-element, arrive whole and bit-exact (both ends in this process)."""
    from pdserve.kv_transfer.transports import tcp

    monkeypatch.setattr(tcp, "STAGE_BYTES", 4999)
    want = make_caches(7, torch.bfloat16, block_dim=1)
    src_kv = {k: v.to("cuda:0") for k, v in want.items()}
    dst_kv = {k: torch.zeros_like(v) for k, v in src_kv.items()}
    leases = LeaseTable()
    server, port = start_transport("tcp", src_kv, leases, TransportOptions(checksum=True))
    client, _ = start_transport("tcp", dst_kv, LeaseTable(), TransportOptions(checksum=True))
    try:
        src, dst = [3, 4, 5, 9], [0, 1, 2, 12]
        leases.add("r", src, time.time() + 60)
        client.pull(PeerAddress("127.0.0.1", port), "r", src, dst, time.monotonic() + 60)
        for name, tensor in dst_kv.items():
            got = tensor.cpu()
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(got[:, d].view(torch.uint8), want[name][:, s].view(torch.uint8))
    finally:
        client.close()
        server.close()


@pytest.mark.parametrize("kind", ["crc32", "wsum64"])
def test_checksums_agree_between_host_and_device(kind: str) -> None:
    """A CPU peer and a GPU peer compute the same checksum over the same bytes."""
    from pdserve.kv_transfer.integrity import checksum

    host = [t[2:9] for t in make_caches(11, torch.bfloat16, block_dim=0).values()]
    host.append(torch.arange(7, dtype=torch.uint8))  # a size that is no multiple of 4
    device = [t.to("cuda:0") for t in host]
    assert checksum(device, kind) == checksum(host, kind)


@pytest.mark.parametrize("name", ["tcp", "ucx", "torch"])
def test_device_kv_moves_only_with_the_cluster_secret(name: str) -> None:
    """The cluster-secret handshake in front of device memory: the right secret moves
    the blocks bit-exact; a wrong one is refused before any block moves."""
    from pdserve.core.cluster_secret import ClusterSecret

    right = ClusterSecret(b"gpu-cluster-secret-0123456789")
    server_dev, client_dev = _devices(name)
    torch.cuda.set_device(client_dev)
    peer = KVPeer(name, {"secret": right}, device=server_dev)
    key = (1, "bfloat16")
    try:
        for secret, ok in ((ClusterSecret(b"not-the-cluster-secret-9876"), False), (right, True)):
            caches = {k: torch.zeros_like(v) for k, v in make_caches(
                0, torch.bfloat16, block_dim=1, device=client_dev).items()}
            transport, _ = start_transport(name, caches, LeaseTable(),
                                           TransportOptions(secret=secret))
            try:
                req = f"s-{ok}"
                peer.lease(key, req, [3, 4])
                address = PeerAddress("127.0.0.1", peer.ports[key])
                if not ok:
                    with pytest.raises(TransferError, match="secret"):
                        transport.pull(address, req, [3, 4], [5, 6], time.monotonic() + 30)
                    assert all(not t.any() for t in caches.values())  # nothing arrived
                    continue
                transport.pull(address, req, [3, 4], [5, 6], time.monotonic() + 60)
                want = make_caches(kv_seed(*key), torch.bfloat16, block_dim=1)
                for n, tensor in caches.items():
                    assert torch.equal(tensor[:, [5, 6]].cpu().view(torch.uint8),
                                       want[n][:, [3, 4]].view(torch.uint8))
            finally:
                transport.close()
    finally:
        peer.stop()
