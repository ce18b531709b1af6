"""The cluster KV pool's compressed blocks (``--kv-compression`` other than ``none``).

A pool pull names the puller's encoding (``encoding_tag``: the codec and its format
version; ``none`` for raw bytes); the serving peer refuses one that is not its own with
an ``incompatible`` reply (``IncompatiblePeerError`` on the puller, which recomputes),
before it reads any block: a puller with ``int8`` never takes ``none`` or ``fp8`` bytes.
The router plans no such pull (it groups pool peers by their Health's
``kv_compression``); the refusal is the safety net (a version skew, a stale view).

Raw pulls keep the transport's data path (``pull.py``). A compressed pull::

    client -> {"op": "pool_pull", "hashes", "encoding", "checksum"}
    server -> {"ok": true, "sizes": [...], "crc32"} | {"ok": false, "error"}
    server -> the payloads, block after block, on the control connection
    server -> {"ok": true, "bytes"}                                  (trailer)

The payloads' sizes are known only once the serving peer has encoded them, so they
travel on the control connection whatever the transport (encrypted under TLS).
The peer encodes every block before its reply and refuses if a host-tier slot was
rewritten meanwhile, so what it sends is one snapshot of the blocks. Each payload is the
codec's own (``remote/compression``, as the cluster store keeps it: header, per-head
scales for the lossy codecs); the puller decodes it into its KV cache, and a payload
that does not decode fails the pull (``TransferError``), never writes wrong KV that is
then used.
"""

from __future__ import annotations

import socket
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_into_exact,
    recv_msg,
    send_msg,
    set_deadline,
)
from pdserve.kv_transfer.pull import SEND_TIMEOUT_S
from pdserve.kv_transfer.remote.compression import BlockCodec, encoding_tag

RAW = "none"  # the encoding of a pull that moves the engine's raw bytes
# A payload may exceed its block's raw size by this factor plus ``SLACK_BYTES`` (a frame
# of incompressible bytes, small scale groups); a reply naming more is refused.
MAX_GROWTH = 2
SLACK_BYTES = 64 << 10

Count = Callable[..., None]  # the transport's counters (``_count(name=delta, ...)``)
Wait = Callable[[float], object]  # sleeps up to its seconds (the transport's stop event)


class PoolChecksumError(TransferError):
    """The payloads' CRC-32 differs from the one the serving peer sent."""


class PoolCodec:
    """One worker's pool encoding: the codec it pulls and serves with, and both ends
    of a compressed pull. Thread-safe (the codecs are)."""

    def __init__(self, codec: BlockCodec) -> None:
        self.codec = codec
        self.encoding = encoding_tag(codec.name)

    def serve(self, conn: socket.socket, blocks: Sequence[Sequence[torch.Tensor]],
              unchanged: Callable[[], bool], checksum: bool, finish: Callable[[bool], None],
              count: Count, rate: float = 0.0, wait: Wait = time.sleep) -> None:
        """Serve a compressed pull of ``blocks``: encoded and checked before the reply;
        sent at most at ``rate`` bytes/s (0: at once; ``throttle_bytes_per_s``); the
        outcome counted (and ``finish`` told) before the trailer goes out, as a raw
        pull's, so a peer that has the trailer sees it counted. Raises (``OSError``,
        ``TransferError``) when the connection fails: the server then closes it."""
        start = time.perf_counter_ns()
        try:
            payloads = self.encode(blocks, unchanged)
        except TransferError as exc:
            count(transfers_failed=1)
            finish(False)
            send_msg(conn, {"ok": False, "error": str(exc)})
            return
        total = sum(len(p) for p in payloads)
        deadline = time.monotonic() + SEND_TIMEOUT_S + (total / rate if rate else 0.0)
        try:
            sent = self.send(conn, payloads, checksum, deadline, rate, wait)
        except (OSError, TransferError):
            count(transfers_failed=1)
            finish(False)
            raise
        count(bytes_sent=sent, transfers_completed=1,
              transfer_time_ns=time.perf_counter_ns() - start)
        finish(True)
        send_msg(conn, {"ok": True, "bytes": sent})

    def encode(self, blocks: Sequence[Sequence[torch.Tensor]],
               unchanged: Callable[[], bool]) -> list[bytes]:
        """Each block's payload; ``TransferError`` if one cannot be encoded (a lossy codec
        refuses NaN or inf) or a block was rewritten while it was read."""
        try:
            payloads = [self.codec.encode(block) for block in blocks]
        except ValueError as exc:
            raise TransferError(f"a KV block cannot be encoded as {self.encoding}: "
                                f"{exc}") from exc
        if not unchanged():
            raise TransferError("blocks rewritten while sent")
        return payloads

    def send(self, conn: socket.socket, payloads: Sequence[bytes], checksum: bool,
             deadline: float, rate: float = 0.0, wait: Wait = time.sleep) -> int:
        """The reply naming each payload's size (and, asked, their CRC-32), then the
        payloads (paced to ``rate`` bytes/s when > 0); the bytes sent."""
        crc = 0
        if checksum:
            for payload in payloads:
                crc = zlib.crc32(payload, crc)
        set_deadline(conn, deadline)
        send_msg(conn, {"ok": True, "sizes": [len(p) for p in payloads],
                        "crc32": crc if checksum else None})
        started, sent = time.monotonic(), 0
        for payload in payloads:
            set_deadline(conn, deadline)
            conn.sendall(payload)
            sent += len(payload)
            ahead = started + sent / rate - time.monotonic() if rate else 0.0
            if ahead > 0:
                wait(ahead)
        return sent

    def receive(self, conn: socket.socket, blocks: Sequence[Sequence[torch.Tensor]],
                checksum: bool, deadline: float, what: str) -> int:
        """Read the reply, the payloads and the trailer, decoding each payload into its
        block's tensors; the payload bytes. ``TransferError`` for a refusal, a reply
        that does not fit the blocks, a payload that does not decode or (asked) a CRC
        mismatch; after one, the blocks may hold partial data (recompute them)."""
        set_deadline(conn, deadline)
        reply = check_reply(recv_msg(conn), what)
        sizes = _sizes(reply, blocks, what)
        crc = total = 0
        for block, size in zip(blocks, sizes, strict=True):
            payload = memoryview(bytearray(size))
            set_deadline(conn, deadline)
            recv_into_exact(conn, payload)
            crc = zlib.crc32(payload, crc) if checksum else 0
            try:
                self.codec.decode(payload, block)
            except ValueError as exc:
                raise TransferError(f"{what}: a block does not decode: {exc}") from exc
            total += size
        set_deadline(conn, deadline)
        check_reply(recv_msg(conn), what)
        if checksum and reply.get("crc32") != crc:
            raise PoolChecksumError(f"{what}: checksum mismatch (sender "
                                    f"{reply.get('crc32')}, received {crc})")
        if blocks and blocks[0] and blocks[0][0].device.type == "cuda":
            torch.cuda.synchronize(blocks[0][0].device)  # done means written
        return total


def _sizes(reply: dict[str, Any], blocks: Sequence[Sequence[torch.Tensor]],
           what: str) -> list[int]:
    """The reply's payload sizes, one per block, each at most its bound."""
    sizes = reply.get("sizes")
    if not isinstance(sizes, list) or len(sizes) != len(blocks):
        raise TransferError(f"{what}: the peer's reply names no size for each of "
                            f"{len(blocks)} blocks")
    for size, block in zip(sizes, blocks, strict=True):
        raw = sum(t.numel() * t.element_size() for t in block)
        if (not isinstance(size, int) or isinstance(size, bool)
                or not 0 < size <= MAX_GROWTH * raw + SLACK_BYTES):
            raise TransferError(f"{what}: a payload of {size!r} bytes for a block of {raw}")
    return sizes
