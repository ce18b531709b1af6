"""The cluster KV pool under ``--kv-compression``, without vLLM: a lossless pool pull
lands the very bits a raw one does (NaN payloads, -0.0 and subnormals too) while moving
fewer bytes, int8 and fp8 pulls stay within the store codecs' per-group bounds, a pull
between workers whose encodings differ is refused before a block is read (counted on
both sides, nothing written), and a payload damaged on the wire fails the pull."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, encoder_frozen_at, make_caches, start_transport
from unit.connector_fakes import poll_until_finished
from unit.test_kv_pool import TRANSPORTS, _block, _Pair
from unit.test_kv_tiers import CONFIG, _h

from pdserve.kv_transfer import pool_codec
from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.control.wire import IncompatiblePeerError, TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.metadata import PdserveConnectorMetadata, PoolLoad
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.tiers.store import TierStore
from pdserve.kv_transfer.worker_side import WorkerSide

SRC, DST = [3, 4, 5], [10, 2, 7]
HEADS, TOKENS, HEAD_DIM = 3, 16, 64  # pdserve_testing's LAYER_SHAPE: (blocks, 3, 16, 128)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16}
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def _codec(caches: dict[str, torch.Tensor], name: str) -> Any:
    return codec_for(name, KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16))


class _CodecPair(_Pair):
    """``_Pair``'s serving and pulling workers, each with its own pool encoding."""

    def __init__(self, transport: str, server: str, client: str,  # noqa: PLW0231
                 dtype: torch.dtype = torch.float32, checksum: bool = False,
                 block_dim: int = 0, rate: float = 0.0, stall_s: float | None = None) -> None:
        options = TransportOptions(checksum=checksum, throttle_bytes_per_s=rate,
                                   stall_s=stall_s)
        self.src = make_caches(1, dtype, block_dim=block_dim)
        self.dst = make_caches(2, dtype, block_dim=block_dim)
        layout = KVLayout.from_kv_caches(self.src, NUM_BLOCKS, 16)
        self.store = TierStore(list(self.src.values()), layout, 8, True, None, "")
        self.server, self.port = start_transport(transport, self.src, LeaseTable(), options)
        self.server.serve_pool(self.store.serve)
        self.server.use_pool_codec(_codec(self.src, server))
        self.client, _ = start_transport(transport, self.dst, LeaseTable(), options)
        self.client.use_pool_codec(_codec(self.dst, client))
        self.peer = PeerAddress("127.0.0.1", self.port)

    def pull(self, dst: list[int] = DST) -> int:
        return self.client.pull_pool(self.peer, [_h(b) for b in SRC], dst,
                                     time.monotonic() + 20)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextmanager
def _pair(transport: str, server: str, client: str, **kwargs: Any) -> Iterator[_CodecPair]:
    pair = _CodecPair(transport, server, client, **kwargs)
    try:
        yield pair
    finally:
        pair.close()


def _with_specials(caches: dict[str, torch.Tensor]) -> None:
    """NaN (two payloads), infinities, -0.0, a subnormal in every source block."""
    for t in caches.values():
        info = torch.finfo(t.dtype)
        for i, v in enumerate((math.nan, math.inf, -math.inf, -0.0, info.tiny / 4)):
            t[SRC, 0, i, 0] = v
        bits = t.view(BITS[t.dtype])
        bits[SRC, 1, 0, 0] = bits[SRC, 0, 0, 0] | 1  # a NaN with another payload


def _bits(block: list[torch.Tensor]) -> list[torch.Tensor]:
    return [t.contiguous().view(BITS[t.dtype]) for t in block]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_lossless_pool_pull_lands_the_bits_a_raw_pull_lands(transport: str,
                                                              dtype: torch.dtype) -> None:
    landed: dict[str, list[list[torch.Tensor]]] = {}
    sent: dict[str, int] = {}
    for name in ("none", "lossless"):
        with _pair(transport, name, name, dtype=dtype) as pair:
            _with_specials(pair.src)
            pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
            before = pair.server.stats()["bytes_sent"]
            sent[name] = pair.pull()
            assert pair.server.stats()["bytes_sent"] - before == sent[name]
            landed[name] = [_bits(_block(pair.dst, d)) for d in DST]
            want = [_bits(_block(pair.src, s)) for s in SRC]
            for have, expect in zip(landed[name], want, strict=True):  # every bit, NaNs too
                assert all(torch.equal(a, b) for a, b in zip(have, expect, strict=True))
            raw = 3 * pair.store.host.block_bytes  # type: ignore[union-attr]
    assert sent["none"] == raw
    assert sent["lossless"] != raw  # it moved the codec's payloads (header, zstd frames)
    for lossless, none in zip(landed["lossless"], landed["none"], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(lossless, none, strict=True))


def _group_max(x: torch.Tensor) -> torch.Tensor:
    """Each value's group absmax: one token's K or V of one head (``head_dim`` values)."""
    v = x.abs().view(HEADS, TOKENS, 2, HEAD_DIM)
    return v.amax(dim=3, keepdim=True).expand_as(v).reshape(x.shape)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_a_lossy_pool_pull_stays_within_the_codecs_bound(transport: str, name: str) -> None:
    with _pair(transport, name, name) as pair:
        for t in pair.src.values():  # groups 1000x apart: one scale per block would fail
            t[:, :, :, HEAD_DIM:] *= 1e-3
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        nbytes = pair.pull()
        raw = 3 * pair.store.host.block_bytes  # type: ignore[union-attr]
        assert nbytes < raw / 3  # float32 to one byte a value, plus a scale per group
        for s, d in zip(SRC, DST, strict=True):
            for x, y in zip(_block(pair.src, s), _block(pair.dst, d), strict=True):
                amax, err = _group_max(x), (x - y).abs()
                if name == "int8":
                    bound = amax / 254 * (1 + 1e-5) + amax * 1.01 * EPS[torch.float32]
                else:
                    bound = x.abs() / 16 + amax / 448 * 2.0**-9
                assert bool((err <= bound).all()), float((err - bound).max())
                assert not torch.equal(x, y)  # lossy indeed: the codec ran


@pytest.mark.parametrize("name", ["lossless", "int8"])
def test_a_split_kv_layout_pulls_through_the_codec(name: str) -> None:
    """CUDA flash-attention's layout, ``(2, blocks, tokens, heads, head_dim)``: a block is
    two strided chunks per layer, encoded and decoded in place."""
    with _pair("tcp", name, name, block_dim=1) as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        pair.pull()
        for s, d in zip(SRC, DST, strict=True):
            for src, dst in zip(pair.src.values(), pair.dst.values(), strict=True):
                x, y = src[:, s], dst[:, d]
                if name == "lossless":
                    assert torch.equal(x.view(torch.int32), y.view(torch.int32))
                    continue
                amax = x.abs().amax(dim=-1, keepdim=True)  # one token's K or V of a head
                bound = amax / 254 * (1 + 1e-5) + amax * 1.01 * EPS[torch.float32]
                assert bool(((x - y).abs() <= bound).all())
                assert not torch.equal(x, y)
        untouched = [t[:, 0] for t in pair.dst.values()]  # no other block was written
        assert all(torch.equal(a, b[:, 0]) for a, b in zip(
            untouched, make_caches(2, torch.float32, block_dim=1).values(), strict=True))


@pytest.mark.parametrize(("server", "client"), [("int8", "none"), ("none", "int8"),
                                                ("int8", "fp8"), ("lossless", "none")])
def test_a_pull_in_another_encoding_is_refused_before_a_block_is_read(
        transport: str, server: str, client: str) -> None:
    with _pair(transport, server, client) as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        before = [_block(pair.dst, d) for d in DST]
        refused = pair.server.stats()["pool_serve_refusals"]
        with pytest.raises(IncompatiblePeerError, match="--kv-compression"):
            pair.pull()
        assert pair.server.stats()["pool_serve_refusals"] == refused + 1
        assert pair.store.stats()["pool_serve_failures"] == 0  # no block was looked up
        for d, b in zip(DST, before, strict=True):
            assert all(torch.equal(x, y) for x, y in zip(_block(pair.dst, d), b, strict=True))
        pair.client.use_pool_codec(_codec(pair.dst, server))  # the same: it works
        pair.pull()
        assert pair.server.stats()["pool_serve_refusals"] == refused + 1


def test_a_worker_counts_the_pool_pulls_a_peer_refused() -> None:
    with _pair("tcp", "int8", "none") as pair:
        side = WorkerSide(CONFIG, {}, 0, 16, NUM_BLOCKS)
        side._transport.close()
        side._transport = pair.client  # the pulling worker's transport, already started
        side._io._transport = pair.client  # the pool pulls through it
        try:
            pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
            before = side._status_extra()
            side.start_step(PdserveConnectorMetadata(pool_loads={
                "r": PoolLoad("127.0.0.1", pair.port, tuple(_h(b) for b in SRC),
                              tuple(DST))}))
            _, failed = poll_until_finished(side, "r")
            after = side._status_extra()
            assert failed == {"r"}  # vLLM recomputes the prompt
            assert after["pool_load_refusals"] == before["pool_load_refusals"] + 1
            assert after["pool_load_failures"] == before["pool_load_failures"] + 1
        finally:
            side._pool.shutdown(wait=True)



@pytest.mark.parametrize(("name", "checksum", "error"), [
    ("lossless", False, "does not decode"),  # zstd's own checksum
    ("int8", True, "checksum mismatch")])  # a flipped code decodes: --kv-checksum finds it
def test_a_payload_damaged_on_the_wire_fails_the_pull(
        monkeypatch: pytest.MonkeyPatch, name: str, checksum: bool, error: str) -> None:
    real = pool_codec.recv_into_exact
    received: list[int] = []

    def damaged(conn: Any, view: memoryview) -> None:  # the puller's read of a payload
        real(conn, view)
        received.append(len(view))
        if len(received) == 2:
            view[-len(view) // 3] ^= 0x10  # in the second block's body

    with _pair("tcp", name, name, checksum=checksum) as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        monkeypatch.setattr(pool_codec, "recv_into_exact", damaged)
        before = pair.client.stats()
        with pytest.raises(TransferError, match=error):
            pair.pull()
        after = pair.client.stats()
        assert after["transfers_failed"] == before["transfers_failed"] + 1
        assert after["checksum_failures"] == before["checksum_failures"] + int(checksum)
        monkeypatch.setattr(pool_codec, "recv_into_exact", real)
        pair.pull()  # a fresh connection: the next pull works
        assert pair.client.stats()["transfers_completed"] == before["transfers_completed"] + 1


def test_a_block_a_lossy_codec_cannot_encode_ends_the_pull_with_an_error() -> None:
    with _pair("tcp", "int8", "int8") as pair:
        next(iter(pair.src.values()))[SRC[1], 0, 0, 0] = math.nan  # the second block
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        with pytest.raises(TransferError, match="cannot be encoded as int8.v1"):
            pair.pull()
        assert pair.store.stats()["pool_serve_failures"] == 1
        assert pair.server.stats()["transfers_failed"] == 1
        pair.client.pull_pool(pair.peer, [_h(SRC[0])], [DST[0]], time.monotonic() + 20)
        assert pair.server.stats()["transfers_completed"] == 1  # the connection recovered


def test_the_server_has_counted_a_compressed_pull_when_the_puller_returns(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = pool_codec.send_msg

    def slow_after_trailer(conn: Any, msg: dict[str, Any]) -> None:
        real(conn, msg)
        if "bytes" in msg:
            time.sleep(0.05)  # the sender stalls right after its trailer is on the wire

    monkeypatch.setattr(pool_codec, "send_msg", slow_after_trailer)
    with _pair("tcp", "lossless", "lossless") as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        for i in range(5):
            nbytes = pair.pull()
            stats = pair.server.stats()  # at once: no wait_until
            assert stats["transfers_completed"] == i + 1
            assert stats["bytes_sent"] == (i + 1) * nbytes
            assert pair.store.stats()["pool_serves"] == i + 1


def test_a_throttled_link_paces_the_compressed_bytes() -> None:
    rate = 100_000.0  # bytes/s: 3 int8 blocks (~80 kB) take ~0.8 s
    with _pair("tcp", "int8", "int8", rate=rate) as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        start = time.monotonic()
        nbytes = pair.pull()
        assert time.monotonic() - start >= 0.95 * nbytes / rate


def test_a_slot_rewritten_while_it_is_encoded_fails_the_pull() -> None:
    with _pair("tcp", "int8", "int8") as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        real = pair.store.serve

        def rewritten(hashes: list[bytes]) -> Any:
            serve = real(hashes)
            pair.save([9], [1], [_h(9)])  # slot 1 gets another block before the reply
            return serve

        pair.server.serve_pool(rewritten)
        with pytest.raises(TransferError, match="rewritten"):
            pair.pull()
        assert pair.store.stats()["pool_serve_failures"] == 1
        assert pair.server.stats()["transfers_failed"] == 1


def test_a_compressed_pull_from_a_peer_gone_silent_fails_at_the_stall_bound() -> None:
    """A cut link or a frozen peer mid-stream: the puller gives up after ``stall_s`` of
    silence (then recomputes), not at its deadline (20 s here)."""
    with _pair("tcp", "lossless", "lossless", stall_s=0.3) as pair:
        pair.save(SRC, [0, 1, 2], [_h(b) for b in SRC])
        started = time.monotonic()
        with encoder_frozen_at(pair.server, 2), pytest.raises(TransferError):
            pair.pull()
        assert time.monotonic() - started < 10

