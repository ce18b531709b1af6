"""The codecs that keep every bit: ``none`` (the raw bytes) and ``lossless`` (zstd).

``lossless`` splits each element into byte planes first (all first bytes, then all
second bytes, ...: the "shuffle" of Blosc and HDF5): a float's sign/exponent byte varies
little across a block and compresses, its low mantissa bytes are nearly random and do
not; interleaved, zstd sees neither pattern. The frame carries zstd's content checksum,
so a corrupt body is refused, not misdecoded (a flip in a flag the frame does not use
decodes the same bytes), and so are bytes after the frame.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch
import zstandard

from pdserve.kv_transfer.layout import as_bytes
from pdserve.kv_transfer.remote.compression.base import BlockPlan, as_tensor, take

NONE_ID = 0
LOSSLESS_ID = 1


class NoneCodec:
    """The chunks' bytes, layer after layer, after the header."""

    name = "none"

    def __init__(self, plan: BlockPlan) -> None:
        self._plan = plan

    def encode(self, chunks: Sequence[torch.Tensor]) -> bytes:
        self._plan.check(chunks)
        parts = [as_bytes(c.cpu().contiguous().reshape(-1)) for c in chunks]
        return b"".join([self._plan.header(NONE_ID), *parts])

    def decode(self, payload: bytes | memoryview, out: Sequence[torch.Tensor]) -> None:
        body = self._plan.body(payload, NONE_ID)
        if len(body) != self._plan.raw_bytes:
            raise ValueError(f"a raw KV payload of {len(body)} bytes, the block has "
                             f"{self._plan.raw_bytes}")
        decoded, at = [], 0
        for start, n in self._plan.runs:
            lay = self._plan.layers[start]
            data, at = take(body, at, n * lay.nbytes)
            decoded.append(as_tensor(data, lay.dtype, (n, *lay.shape)))
        self._plan.write(decoded, out)


class LosslessCodec:
    """Byte planes (``shuffle``), then one zstd frame at ``level``."""

    name = "lossless"

    def __init__(self, plan: BlockPlan, level: int = 1, shuffle: bool = True) -> None:
        self._plan = plan
        self._level = level
        self._shuffle = shuffle
        self._local = threading.local()  # zstd contexts are not thread-safe

    def encode(self, chunks: Sequence[torch.Tensor]) -> bytes:
        flat = torch.empty(self._plan.raw_bytes, dtype=torch.uint8)
        at = 0
        for stack in self._plan.stacked(chunks):
            raw = stack.reshape(-1).view(torch.uint8)
            size = stack.element_size()
            dst = flat[at:at + raw.numel()]
            if self._shuffle and size > 1:
                dst.view(size, -1).copy_(raw.view(-1, size).t())
            else:
                dst.copy_(raw)
            at += raw.numel()
        frame = self._compressor().compress(as_bytes(flat))
        return b"".join((self._plan.header(LOSSLESS_ID), frame))

    def decode(self, payload: bytes | memoryview, out: Sequence[torch.Tensor]) -> None:
        body = self._plan.body(payload, LOSSLESS_ID)
        try:  # the frame's declared size first: zstd would allocate whatever it says
            declared = zstandard.frame_content_size(body)
            if declared != self._plan.raw_bytes:
                raise ValueError(f"a lossless KV payload declaring {declared} bytes, the "
                                 f"block has {self._plan.raw_bytes}")
            raw = self._decompressor().decompress(body, max_output_size=self._plan.raw_bytes,
                                                  allow_extra_data=False)
        except zstandard.ZstdError as exc:
            raise ValueError(f"a corrupt lossless KV payload: {exc}") from exc
        if len(raw) != self._plan.raw_bytes:
            raise ValueError(f"a lossless KV payload of {len(raw)} bytes decompressed, the "
                             f"block has {self._plan.raw_bytes}")
        view, at, decoded = memoryview(raw), 0, []
        for start, n in self._plan.runs:
            lay = self._plan.layers[start]
            data, at = take(view, at, n * lay.nbytes)
            size = lay.dtype.itemsize
            planes = as_tensor(data, torch.uint8, (len(data),))
            if self._shuffle and size > 1:
                planes = planes.view(size, -1).t().contiguous()
            decoded.append(planes.view(lay.dtype).view(n, *lay.shape))
        self._plan.write(decoded, out)

    def _compressor(self) -> zstandard.ZstdCompressor:
        if not hasattr(self._local, "c"):
            self._local.c = zstandard.ZstdCompressor(level=self._level, write_checksum=True,
                                                     write_content_size=True)
        return self._local.c

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        if not hasattr(self._local, "d"):
            self._local.d = zstandard.ZstdDecompressor()
        return self._local.d
