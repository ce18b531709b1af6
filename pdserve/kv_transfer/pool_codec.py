"""Compressed KV blocks (``--kv-compression`` other than ``none``), pulled from a peer's
host tier (the cluster KV pool) or, where it pays, from a prefill's lease (the P->D
handoff: ``coded_pull.py`` decides and asks; a peer with another encoding refuses it the
same way, and the decode then pulls raw).

A pool pull names the puller's encoding (``encoding_tag``: the codec and its format
version; ``none`` for raw bytes); the serving peer refuses one that is not its own with
an ``incompatible`` reply (``IncompatiblePeerError`` on the puller, which recomputes),
before it reads any block: a puller with ``int8`` never takes ``none`` or ``fp8`` bytes.
The router plans no such pull (it groups pool peers by their Health's
``kv_compression``); the refusal is the safety net (a version skew, a stale view).

Raw pulls keep the transport's data path (``pull.py``). A compressed pull::

    client -> {"op": "pool_pull", "hashes", "encoding", "checksum"}
    server -> {"ok": true} | {"ok": false, "error"}
    server -> per block: its payload's length (u32, big-endian), the payload
              (a length of 0: the stream ends early, an error trailer follows)
    server -> {"ok": true, "bytes", "crc32", "encode_ns"} | {"ok": false, "error"}

A payload's length is known only once the peer has encoded it, so compressed blocks
travel on the control connection whatever the transport (encrypted under TLS), one
block encoded, sent and decoded at a time (neither side holds more than one block's
payload). As a raw pull's, the trailer fails if a host-tier slot was rewritten while it
was sent, or a block could not be encoded (a lossy codec refuses NaN or inf). Each
payload is the codec's own (``remote/compression``, as the cluster store keeps it:
header, per-head scales for the lossy codecs); the puller decodes it into its KV cache,
and a payload that does not decode, a length over its block's bound or an error trailer
fails the pull (``TransferError``): the blocks are then recomputed, never used.
The trailer's ``encode_ns`` (the time the peer spent encoding) and the decode time
measured here come back in a ``Receipt``: what the handoff learns its codec's cost from.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.channel import LEASE_WAIT_S
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_exact,
    recv_into_exact,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.pull import SEND_TIMEOUT_S
from pdserve.kv_transfer.remote.compression import BlockCodec, encoding_tag

RAW = "none"  # the encoding of a pull that moves the engine's raw bytes
# A payload may exceed its block's raw size by this factor plus ``SLACK_BYTES`` (a frame
# of incompressible bytes, small scale groups); a longer one is refused.
MAX_GROWTH = 2
SLACK_BYTES = 64 << 10
_LEN = struct.Struct("!I")
_END = _LEN.pack(0)

Count = Callable[..., None]  # the transport's counters (``_count(name=delta, ...)``)
Wait = Callable[[float], object]  # sleeps up to its seconds (the transport's stop event)


class PoolChecksumError(TransferError):
    """The payloads' CRC-32 differs from the one the serving peer sent."""


@dataclass(frozen=True)
class Receipt:
    """One compressed pull, received: the payload bytes, the peer's encode time (its
    trailer's word: 0 from a peer that does not say), the decode time here, and the
    time from the peer's first reply to its trailer (the link's and both codecs')."""

    nbytes: int
    encode_ns: int
    decode_ns: int
    data_ns: int


class PoolCodec:
    """One worker's pool encoding: the codec it pulls and serves with, and both ends
    of a compressed pull. Thread-safe (the codecs are)."""

    def __init__(self, codec: BlockCodec) -> None:
        self.codec = codec
        self.encoding = encoding_tag(codec.name)

    def serve(self, conn: socket.socket, blocks: Sequence[Sequence[torch.Tensor]],
              unchanged: Callable[[], bool], checksum: bool, finish: Callable[[bool], None],
              count: Count, rate: float = 0.0, wait: Wait = time.sleep) -> None:
        """Serve a compressed pull of ``blocks``, paced to ``rate`` bytes/s (0: off;
        ``throttle_bytes_per_s``). The outcome is counted (and ``finish`` told) before
        the trailer goes out, as a raw pull's, so a peer that has the trailer sees it
        counted. Raises (``OSError``, ``TransferError``, or whatever encoding raised) when
        the stream cannot go on: counted as failed, and the server closes the connection."""
        start = time.perf_counter_ns()
        deadline = time.monotonic() + SEND_TIMEOUT_S
        try:
            send_msg(conn, {"ok": True})
            sent, crc, encode_ns, error = self._stream(conn, blocks, checksum, deadline,
                                                       rate, wait)
            if error is None and not unchanged():  # sent whole: the stream is intact
                error = "blocks rewritten while sent"
        except BaseException:  # the connection failed, or encoding did: the server closes it
            count(transfers_failed=1)
            finish(False)
            raise
        if error is not None:
            count(bytes_sent=sent, transfers_failed=1)
            finish(False)
            send_msg(conn, {"ok": False, "error": error})
            return
        count(bytes_sent=sent, transfers_completed=1,
              transfer_time_ns=time.perf_counter_ns() - start)
        finish(True)
        send_msg(conn, {"ok": True, "bytes": sent, "crc32": crc if checksum else None,
                        "encode_ns": encode_ns})

    def _stream(self, conn: socket.socket, blocks: Sequence[Sequence[torch.Tensor]],
                checksum: bool, deadline: float, rate: float, wait: Wait
                ) -> tuple[int, int, int, str | None]:
        """Encode and send each block; the payload bytes sent, their CRC-32 (0 unless
        ``checksum``), the time spent encoding and the error that ended the stream
        early (None: it did not)."""
        started, sent, crc, encode_ns = time.monotonic(), 0, 0, 0
        for block in blocks:
            t0 = time.perf_counter_ns()
            try:
                payload = self.codec.encode(block)
            except ValueError as exc:
                set_deadline(conn, deadline)
                conn.sendall(_END)
                return (sent, crc, encode_ns,
                        f"a KV block cannot be encoded as {self.encoding}: {exc}")
            encode_ns += time.perf_counter_ns() - t0
            if checksum:
                crc = zlib.crc32(payload, crc)
            set_deadline(conn, deadline + (sent / rate if rate else 0.0))
            conn.sendall(_LEN.pack(len(payload)))
            conn.sendall(payload)
            sent += len(payload)
            ahead = started + sent / rate - time.monotonic() if rate else 0.0
            if ahead > 0:
                wait(ahead)
        return sent, crc, encode_ns, None

    def receive(self, conn: socket.socket, blocks: Sequence[Sequence[torch.Tensor]],
                checksum: bool, deadline: float, what: str,
                stall_s: float | None = None) -> Receipt:
        """Read the reply, each block's payload (decoded into its tensors as it comes)
        and the trailer. ``TransferError`` for a refusal (``IncompatiblePeerError``: the
        peer's encoding differs; nothing was written), a payload
        over its bound or that does not decode, an error trailer or (asked) a CRC
        mismatch; after one, the blocks may hold partial data (recompute them). With
        ``stall_s``, a peer silent that long fails it too (its first reply may take
        ``LEASE_WAIT_S`` more: a lease announced late)."""
        set_deadline(conn, deadline, None if stall_s is None else stall_s + LEASE_WAIT_S)
        check_reply(recv_msg(conn), what)
        data_start = time.perf_counter_ns()
        crc = total = got = decode_ns = 0
        for block in blocks:
            set_deadline(conn, deadline, stall_s)
            head = recv_exact(conn, _LEN.size)
            (size,) = _LEN.unpack(head or _END)
            if size == 0:  # ended early: the trailer says why
                break
            bound = MAX_GROWTH * sum(t.numel() * t.element_size() for t in block) + SLACK_BYTES
            if size > bound:
                raise TransferError(f"{what}: a payload of {size} bytes, at most {bound}")
            payload = memoryview(bytearray(size))
            recv_into_exact(conn, payload)
            crc = zlib.crc32(payload, crc) if checksum else 0
            t0 = time.perf_counter_ns()
            try:
                self.codec.decode(payload, block)
            except ValueError as exc:
                raise TransferError(f"{what}: a block does not decode: {exc}") from exc
            decode_ns += time.perf_counter_ns() - t0
            total, got = total + size, got + 1
        set_deadline(conn, deadline, stall_s)
        trailer = check_reply(recv_msg(conn), what)
        if got != len(blocks) or trailer.get("bytes") != total:
            raise TransferError(f"{what}: {got} of {len(blocks)} blocks, {total} bytes; "
                                f"the trailer says {trailer.get('bytes')!r} bytes")
        if checksum and trailer.get("crc32") != crc:
            raise PoolChecksumError(f"{what}: checksum mismatch (sender "
                                    f"{trailer.get('crc32')}, received {crc})")
        if blocks and blocks[0] and blocks[0][0].device.type == "cuda":
            torch.cuda.synchronize(blocks[0][0].device)  # done means written
        encode_ns = fields.optional_integer(trailer, "encode_ns", 0, 1 << 62) or 0
        return Receipt(total, encode_ns, decode_ns, time.perf_counter_ns() - data_start)
