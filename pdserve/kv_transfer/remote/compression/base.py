"""The contract of a KV block codec, the header every payload starts with, and where a
block's heads are.

A block is one tensor per layer: the block's slice of that layer's KV cache, the layer's
shape without its block dimension (``KVLayout``'s ``block_dim``). ``encode`` turns the
chunks of one block into bytes; ``decode`` writes them back into tensors of the same
shapes and dtypes (any device, any strides: it decodes on the CPU, then ``copy_``).

Every payload starts with a 24-byte header: ``PDKZ``, the format version, the codec's
id, two zero bytes, 8 bytes of BLAKE2b over the block's layer shapes and dtypes, and
the block's raw size (u64). ``decode`` refuses (``ValueError``) a payload whose header
names another codec, version or block shape, or whose length is wrong: a worker with
other settings is refused, never misread. (The store's value frame, ``codec.py``, checks
the bytes' CRC; the identity, ``names.py``, keeps the codec in the key, so a refusal
here means a bug or corruption, and the caller counts a bad block and recomputes.)

Where the heads are, from ``KVLayout`` (``layout.py``), for the lossy codecs' scales:
one scale per token, head and K or V (the ``head_dim`` values of one vector), which
measured 2-4x less error than one per head and block on the default model's KV (K has
a few large tokens).

- ``block_dim == 0`` (vLLM's CPU backends, a layer ``(blocks, kv_heads, block_size,
  2 * head_dim)``): a chunk is ``(kv_heads, block_size, 2 * head_dim)``; the head is
  dim 0. Within a head, vLLM's ``cpu_attn`` keeps K in the first half of the head's
  bytes (it views ``(2 * block_size, head_dim)`` and splits rows) while other backends
  with this shape split the last dim (``flash_attn``'s ``split(head_size, dim=-1)``);
  under both, each run of ``head_dim`` values along the last dim is one token's K or V
  of one head: the chunk is viewed ``(heads, block_size, 2, head_dim)``, a scale each.
- ``block_dim == 1`` with 2 outer entries (CUDA flash-attention, ``(2, blocks,
  block_size, kv_heads, head_dim)``): a chunk is ``(2, block_size, kv_heads,
  head_dim)`` (K/V, token, head): a scale per (K/V, token, head).
- Any other shape: one scale per outer entry (per layer on a single-chunk layout).
"""

from __future__ import annotations

import json
import struct
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from hashlib import blake2b
from typing import Protocol

import torch

from pdserve.kv_transfer.layout import KVLayout, LayerLayout

CODECS = ("none", "lossless", "int8", "fp8")  # the --kv-compression names, in id order
VERSION = 1
_HEADER = struct.Struct("<4sBBH8sQ")  # magic, version, codec id, zero pad, digest, raw
_MAGIC = b"PDKZ"
HEADER_BYTES = _HEADER.size


class BlockCodec(Protocol):
    """Encodes one block's per-layer chunks (in the layout's layer order) and back.

    ``encode`` reads the chunks (any device; they must not change until it returns) and
    returns new bytes; it raises ``ValueError`` on chunks of another shape or dtype, and
    a lossy codec on non-finite values (NaN, inf), which it cannot carry. ``decode``
    writes every ``out`` tensor or raises ``ValueError`` (another codec, version or block
    shape, a wrong length, a corrupt body); after a ``ValueError`` the ``out`` tensors
    may hold partial data and must be recomputed. Both are thread-safe."""

    name: str

    def encode(self, chunks: Sequence[torch.Tensor]) -> bytes: ...

    def decode(self, payload: bytes | memoryview, out: Sequence[torch.Tensor]) -> None: ...


def encoding_tag(name: str) -> str:
    """What ``KVIdentity.kv_encoding`` holds for codec ``name``: its name and the
    format's version ("none" stays "none": raw bytes have no format)."""
    check_name(name)
    return name if name == "none" else f"{name}.v{VERSION}"


def check_name(name: str) -> None:
    if name not in CODECS:
        raise ValueError(f"unknown KV compression {name!r}; valid: {', '.join(CODECS)}")


@dataclass(frozen=True)
class LayerPlan:
    """One layer's chunk: its shape and dtype, and the view whose ``keep`` dims index
    its scale groups (see the module docstring)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    group_view: tuple[int, ...]
    keep: tuple[int, ...]

    @property
    def numel(self) -> int:
        return _prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def num_groups(self) -> int:
        return _prod(tuple(self.group_view[d] for d in self.keep))


@dataclass(frozen=True)
class BlockPlan:
    """A block of a layout: its layers, the runs of equal layers (coded as one stacked
    tensor), its digest and raw size."""

    layers: tuple[LayerPlan, ...]
    runs: tuple[tuple[int, int], ...]  # (first layer, count) of equal consecutive layers
    digest: bytes
    raw_bytes: int

    @classmethod
    def of(cls, layout: KVLayout) -> BlockPlan:
        layers = tuple(_layer_plan(lay) for lay in layout.layers)
        runs: list[tuple[int, int]] = []
        for i, plan in enumerate(layers):
            if runs and layers[runs[-1][0]] == plan:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((i, 1))
        text = json.dumps([[list(p.shape), str(p.dtype)] for p in layers])
        digest = blake2b(text.encode(), digest_size=8, person=b"pdserve-kvz").digest()
        return cls(layers, tuple(runs), digest, sum(p.nbytes for p in layers))

    def header(self, codec_id: int) -> bytes:
        return _HEADER.pack(_MAGIC, VERSION, codec_id, 0, self.digest, self.raw_bytes)

    def body(self, payload: bytes | memoryview, codec_id: int) -> memoryview:
        """``payload`` without its header, once the header is this block's under codec
        ``codec_id``; ``ValueError`` naming what differs otherwise."""
        view = memoryview(payload).cast("B")
        if len(view) < HEADER_BYTES:
            raise ValueError(f"a KV payload of {len(view)} bytes has no header")
        magic, version, cid, pad, digest, raw = _HEADER.unpack_from(view)
        if magic != _MAGIC or pad != 0:
            raise ValueError("not a KV block payload (bad magic)")
        if version != VERSION:
            raise ValueError(f"KV payload format v{version}, this worker reads v{VERSION}")
        if cid != codec_id:
            other = CODECS[cid] if cid < len(CODECS) else f"id {cid}"
            raise ValueError(f"KV payload encoded with {other!r}, this worker decodes "
                             f"{CODECS[codec_id]!r}")
        if digest != self.digest or raw != self.raw_bytes:
            raise ValueError("KV payload of another block shape or dtype")
        return view[HEADER_BYTES:]

    def check(self, chunks: Sequence[torch.Tensor], what: str = "a chunk") -> None:
        """``ValueError`` unless ``chunks`` are this block's layers' shapes and dtypes."""
        if len(chunks) != len(self.layers):
            raise ValueError(f"{len(chunks)} tensors for a block of {len(self.layers)} layers")
        for i, (chunk, plan) in enumerate(zip(chunks, self.layers, strict=True)):
            if tuple(chunk.shape) != plan.shape or chunk.dtype != plan.dtype:
                raise ValueError(f"layer {i}: {what} {tuple(chunk.shape)} {chunk.dtype}, "
                                 f"the layout's is {plan.shape} {plan.dtype}")

    def stacked(self, chunks: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One contiguous CPU tensor ``(count, *shape)`` per run of equal layers."""
        self.check(chunks)
        return [torch.stack([c.cpu() for c in chunks[start:start + n]])
                if n > 1 else chunks[start].cpu().contiguous().unsqueeze(0)
                for start, n in self.runs]

    def write(self, decoded: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> None:
        """Copy each run's decoded ``(count, *shape)`` CPU tensor into ``out``'s layers
        (checked first: nothing is written into tensors of another shape)."""
        self.check(out, "an output")
        for (start, n), tensor in zip(self.runs, decoded, strict=True):
            for j in range(n):
                out[start + j].copy_(tensor[j])


def take(body: memoryview, at: int, nbytes: int) -> tuple[memoryview, int]:
    """``nbytes`` of ``body`` from ``at`` and the offset after them; ``ValueError`` when
    the body is shorter."""
    if at + nbytes > len(body):
        raise ValueError(f"a KV payload body of {len(body)} bytes is truncated")
    return body[at:at + nbytes], at + nbytes


def as_tensor(data: memoryview, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A CPU tensor over ``data`` (no copy; read-only data is only ever read)."""
    if len(data) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer: decode only reads it
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(data, dtype=torch.uint8)
    return flat.view(dtype).view(*shape)


def _layer_plan(lay: LayerLayout) -> LayerPlan:
    shape = lay.shape[:lay.block_dim] + lay.shape[lay.block_dim + 1:]
    dtype = getattr(torch, lay.dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"layer {lay.name}: unknown dtype {lay.dtype!r}")
    if lay.block_dim == 0 and len(shape) == 3 and shape[2] % 2 == 0:
        heads, tokens, width = shape
        return LayerPlan(shape, dtype, (heads, tokens, 2, width // 2), (0, 1, 2))
    if lay.block_dim == 1 and len(shape) == 4 and shape[0] == 2:
        return LayerPlan(shape, dtype, shape, (0, 1, 2))
    outer = _prod(shape[:lay.block_dim])
    return LayerPlan(shape, dtype, (outer, _prod(shape) // max(outer, 1)), (0,))


def _prod(dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= d
    return n
