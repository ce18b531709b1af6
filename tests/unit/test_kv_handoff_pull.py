"""P->D pulls of a lease under ``--kv-compression`` (``kv_transfer/coded_pull.py``), over
tcp on loopback, without vLLM: a thin path (the prefill's sends throttled) is measured
by a first raw pull, then pulled lossless, bit-exact, in fewer wire bytes, with the
lease ended; a fast path stays raw; a prefill with another encoding refuses without
ending the lease and the same pull completes raw; an encoded pull that breaks fails
cleanly and the lease does not outlive it."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import pytest
import torch
from pdserve_testing import (
    NUM_BLOCKS,
    encoder_frozen_at,
    make_caches,
    start_transport,
    wait_until,
)

from pdserve.kv_transfer import pool_codec
from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.links import MIN_SAMPLE_BYTES
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.transports.tcp import TcpTransport

EVERY = list(range(NUM_BLOCKS))  # 16 blocks of 96 KiB (float32): 1.5 MiB, a link sample
DST = [(b + 5) % NUM_BLOCKS for b in EVERY]
BLOCK_BYTES = 4 * 3 * 16 * 128 * 4  # pdserve_testing's 4 layers of (3, 16, 128) float32
THIN = 4e6  # bytes/s: far below lossless's break-even (~14.5 MiB/s with the priors)
_reqs = iter(range(10**9))


class _Handoff:
    """A prefill (its lease table, its sends paced to ``rate``) and a decode, in-process,
    each with its own ``--kv-compression``."""

    def __init__(self, prefill: str, decode: str, rate: float = 0.0,
                 checksum: bool = False, stall_s: float | None = None,
                 lossy: bool = True) -> None:
        self.src = make_caches(1, torch.float32)
        self.dst = make_caches(2, torch.float32)
        self.leases = LeaseTable()
        self.server, port = start_transport(
            "tcp", self.src, self.leases,
            TransportOptions(throttle_bytes_per_s=rate, checksum=checksum))
        self.server.use_pool_codec(_codec(self.src, prefill))
        client, _ = start_transport("tcp", self.dst, LeaseTable(),
                                    TransportOptions(checksum=checksum, stall_s=stall_s,
                                                     handoff_lossy=lossy))
        self.client = cast(TcpTransport, client)
        self.client.use_pool_codec(_codec(self.dst, decode))
        self.peer = PeerAddress("127.0.0.1", port)
        self.name = f"127.0.0.1:{port}"

    def pull(self) -> int:
        req = f"r{next(_reqs)}"
        self.leases.add(req, EVERY, time.time() + 30)
        return self.client.pull(self.peer, req, EVERY, DST, time.monotonic() + 30)

    def landed_bit_exact(self) -> bool:
        return all(torch.equal(s[b].view(torch.int32), d[t].view(torch.int32))
                   for s, d in zip(self.src.values(), self.dst.values(), strict=True)
                   for b, t in zip(EVERY, DST, strict=True))

    def measured(self, bytes_per_s: float) -> None:
        """The decode's meter holds a path of ``bytes_per_s`` to the prefill."""
        self.client.links.record(self.name, MIN_SAMPLE_BYTES, 64, MIN_SAMPLE_BYTES / bytes_per_s)

    def close(self) -> None:
        self.client.close()
        self.server.close()


def _codec(caches: dict[str, torch.Tensor], name: str) -> Any:
    return codec_for(name, KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16))


@contextmanager
def _handoff(prefill: str, decode: str, **kwargs: Any) -> Iterator[_Handoff]:
    pair = _Handoff(prefill, decode, **kwargs)
    try:
        yield pair
    finally:
        pair.close()


def _delta(before: dict[str, int], after: dict[str, int], *keys: str) -> tuple[int, ...]:
    return tuple(after[k] - before[k] for k in keys)


def test_a_thin_path_is_measured_raw_then_pulled_lossless_bit_exact() -> None:
    raw = NUM_BLOCKS * BLOCK_BYTES
    with _handoff("lossless", "lossless", rate=THIN) as h:
        before = h.client.stats()
        assert h.pull() == raw  # no estimate yet: raw, and the path is measured
        assert h.client.stats()["encoded_pulls"] == before["encoded_pulls"]
        (link,) = h.client.links.estimates()
        # Measured at the paced rate: the meter times from the reply's arrival, the
        # sender paces from just after sending it, so a hair above THIN (0.005 % seen).
        assert link.bytes_per_s <= 1.01 * THIN and link.bytes_per_token == BLOCK_BYTES / 16
        for t in h.dst.values():
            t.zero_()
        sent = h.server.stats()["bytes_sent"]
        wire = h.pull()
        after = h.client.stats()
        assert wire < raw  # lossless float32: ~1.18x fewer bytes
        assert h.landed_bit_exact()
        assert h.server.stats()["bytes_sent"] - sent == wire  # the server counted them
        assert _delta(before, after, "encoded_pulls", "encoded_bytes_saved") == (1, raw - wire)
        assert h.leases.num_held == 0  # ended before the trailer, so already now
        (link,) = h.client.links.estimates()
        assert link.bytes_per_token == wire / (NUM_BLOCKS * 16)  # the wire bytes a token


def test_a_fast_path_is_pulled_raw() -> None:
    with _handoff("lossless", "lossless") as h:
        h.measured(10e9)  # a path of 10 GB/s: far above the break-even
        before = h.client.stats()
        assert h.pull() == NUM_BLOCKS * BLOCK_BYTES
        assert h.landed_bit_exact()
        assert h.client.stats()["encoded_pulls"] == before["encoded_pulls"]


@pytest.mark.parametrize("prefill", ["none", "int8"])
def test_a_prefill_with_another_encoding_refuses_and_the_pull_completes_raw(
        prefill: str) -> None:
    with _handoff(prefill, "lossless") as h:
        h.measured(THIN)
        before = h.client.stats()
        assert h.pull() == NUM_BLOCKS * BLOCK_BYTES  # the same lease, pulled raw
        assert h.landed_bit_exact()
        assert h.leases.num_held == 0
        assert _delta(before, h.client.stats(), "encoded_pull_refusals", "encoded_pulls",
                      "transfers_failed", "transfers_completed") == (1, 0, 0, 1)
        h.pull()  # that peer is pulled raw now, without asking again
        assert _delta(before, h.client.stats(), "encoded_pull_refusals",
                      "transfers_completed") == (1, 2)


def test_a_lossy_codec_encodes_no_handoff_unless_asked() -> None:
    """``--kv-compression int8`` without ``--kv-handoff-lossy``: the thin path's pull is
    raw and bit-exact (a handoff's KV is fresh: a lossy copy would change the answer)."""
    with _handoff("int8", "int8", lossy=False) as h:
        h.measured(THIN)
        before = h.client.stats()
        assert h.pull() == NUM_BLOCKS * BLOCK_BYTES
        assert h.landed_bit_exact()
        assert _delta(before, h.client.stats(), "encoded_pulls", "transfers_completed") == (
            0, 1)


def test_a_payload_that_does_not_decode_fails_the_pull_and_ends_the_lease(
        monkeypatch: pytest.MonkeyPatch) -> None:
    real = pool_codec.recv_into_exact
    received: list[int] = []

    def damaged(conn: Any, view: memoryview) -> None:  # the decode's read of a payload
        real(conn, view)
        received.append(len(view))
        if len(received) == 2:
            view[-len(view) // 3] ^= 0x10

    with _handoff("lossless", "lossless") as h:
        h.measured(THIN)
        monkeypatch.setattr(pool_codec, "recv_into_exact", damaged)
        before = h.client.stats()
        with pytest.raises(TransferError, match="does not decode"):
            h.pull()
        assert _delta(before, h.client.stats(), "transfers_failed", "encoded_pulls") == (1, 0)
        assert wait_until(lambda: h.leases.num_held == 0, 10, 0.02)  # the prefill's side
        monkeypatch.setattr(pool_codec, "recv_into_exact", real)
        h.pull()  # a fresh connection: the next pull works, raw (a broken encoded pull,
        assert h.landed_bit_exact()  # whatever broke it, makes that peer raw for a while)
        assert _delta(before, h.client.stats(), "encoded_pulls", "transfers_completed") == (
            0, 1)


def test_a_block_the_prefill_cannot_encode_fails_the_pull_and_ends_the_lease() -> None:
    with _handoff("int8", "int8", checksum=True) as h:
        h.measured(THIN)
        next(iter(h.src.values()))[EVERY[3], 0, 0, 0] = math.nan  # int8 cannot carry it
        before = h.client.stats()
        with pytest.raises(TransferError, match="cannot be encoded as int8.v1"):
            h.pull()
        assert h.leases.num_held == 0  # ended before the error trailer
        assert h.server.stats()["transfers_failed"] == 1
        assert _delta(before, h.client.stats(), "transfers_failed") == (1,)


def test_a_prefill_gone_fails_the_encoded_pull() -> None:
    with _handoff("lossless", "lossless") as h:
        h.measured(THIN)
        h.server.close()
        with pytest.raises(TransferError):
            h.client.pull(h.peer, "gone", EVERY, DST, time.monotonic() + 10)


def test_an_encoded_pull_from_a_prefill_gone_silent_fails_at_the_stall_bound() -> None:
    """A cut link mid-stream: the decode gives up after ``stall_s`` of silence (then
    recomputes), not at the pull's deadline; the prefill ends the lease once its send
    gives up."""
    with _handoff("lossless", "lossless", stall_s=0.3) as h:
        h.measured(THIN)
        started = time.monotonic()
        with encoder_frozen_at(h.server, 3), pytest.raises(TransferError):
            h.pull()  # its deadline: 30 s
        assert time.monotonic() - started < 15
        assert wait_until(lambda: h.leases.num_held == 0, 10, 0.02)
