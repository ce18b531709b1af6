"""Checksums of a transfer's KV chunks, computed where the chunks live.

Two kinds: ``crc32`` over the raw bytes (zlib, no copy; the kind for host
memory) and ``wsum64``, a position-weighted sum of the 32-bit words computed on
the device (no copy to host; any change to a single word changes it; the kind
for device memory). The sender picks the kind for its memory and names it in
the trailer; the receiver computes the same kind over what it received, so a
CPU peer and a GPU peer agree too.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from pdserve.kv_transfer.layout import as_bytes

KINDS = ("crc32", "wsum64")
_MASK64 = (1 << 64) - 1


def natural_kind(chunks: Sequence[torch.Tensor]) -> str:
    return "crc32" if not chunks or chunks[0].device.type == "cpu" else "wsum64"


def checksum(chunks: Sequence[torch.Tensor], kind: str) -> int:
    if kind == "crc32":
        crc = 0
        for chunk in chunks:
            host = chunk if chunk.device.type == "cpu" else chunk.cpu()
            crc = zlib.crc32(as_bytes(host), crc)
        return crc
    if kind == "wsum64":
        total = 0
        for chunk in chunks:
            total = (total * 1_000_003 + _weighted_sum(chunk)) & _MASK64
        return total
    raise ValueError(f"unknown checksum kind {kind!r}; valid kinds: {', '.join(KINDS)}")


def _weighted_sum(chunk: torch.Tensor) -> int:
    raw = chunk.reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    weights = torch.arange(1, 2 * words.numel(), 2, device=words.device, dtype=torch.int64)
    return int((words.to(torch.int64) * weights).sum().item()) & _MASK64
