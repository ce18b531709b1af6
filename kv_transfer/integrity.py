"""Checksums of a transfer's KV chunks, computed where the chunks live.

Host memory: CRC-32 over the raw bytes (zlib, no copy). Device memory: a
position-weighted sum of the 32-bit words on the device (no copy to host);
any change to a single word changes it. Both sides of a transfer checksum the
same chunk sequence, so the value only has to be deterministic per device type.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable

import torch

from .layout import as_bytes

_MASK64 = (1 << 64) - 1


def checksum(chunks: Iterable[torch.Tensor]) -> int:
    crc = 0
    device_sum = 0
    for chunk in chunks:
        if chunk.device.type == "cpu":
            crc = zlib.crc32(as_bytes(chunk), crc)
        else:
            device_sum = (device_sum * 1_000_003 + _device_digest(chunk)) & _MASK64
    return (crc << 64) | device_sum


def _device_digest(chunk: torch.Tensor) -> int:
    raw = chunk.reshape(-1).view(torch.uint8)
    if raw.numel() % 4 == 0:
        words = raw.view(torch.int32).to(torch.int64)
    else:
        words = raw.to(torch.int64)
    weights = torch.arange(1, 2 * words.numel(), 2, device=words.device, dtype=torch.int64)
    return int((words * weights).sum().item()) & _MASK64
