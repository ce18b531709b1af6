"""Where one KV block of one layer lives in the tensors vLLM registered.

Read from the tensors themselves, never assumed: vLLM's CPU backend gives each
layer ``(num_blocks, kv_heads, block_size, 2 * head_dim)`` (one contiguous chunk
per block); CUDA flash-attention gives ``(2, num_blocks, block_size, kv_heads,
head_dim)`` (a K chunk and a V chunk per block). Both are "block dim after zero
or more outer dims"; each (outer index, block) slice is one contiguous chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerLayout:
    name: str
    shape: tuple[int, ...]
    dtype: str
    block_dim: int  # index of the num_blocks dimension (0 or 1)

    @property
    def num_outer(self) -> int:
        """Chunks per block (1 on CPU, 2 for split K/V caches)."""
        n = 1
        for d in self.shape[: self.block_dim]:
            n *= d
        return n


@dataclass(frozen=True)
class KVLayout:
    """The registered KV caches of one worker rank, in a fixed layer order."""

    layers: tuple[LayerLayout, ...]
    num_blocks: int
    block_size: int
    device: str

    @classmethod
    def from_kv_caches(
        cls, kv_caches: dict[str, torch.Tensor], num_blocks: int, block_size: int
    ) -> KVLayout:
        if not kv_caches:
            raise ValueError("no KV cache tensors registered")
        layers = []
        devices = set()
        for name, tensor in kv_caches.items():
            layers.append(
                LayerLayout(
                    name=name,
                    shape=tuple(tensor.shape),
                    dtype=str(tensor.dtype).removeprefix("torch."),
                    block_dim=_block_dim(name, tensor, num_blocks),
                )
            )
            devices.add(tensor.device.type)
        if len(devices) != 1:
            raise ValueError(f"KV caches span several device types: {sorted(devices)}")
        return cls(tuple(layers), num_blocks, block_size, devices.pop())

    def describe(self) -> dict[str, object]:
        """What a peer must match for blocks to be interchangeable."""
        return {
            "num_layers": len(self.layers),
            "block_size": self.block_size,
            "layer_shape": list(self.layers[0].shape[self.layers[0].block_dim + 1 :]),
            "block_dim": self.layers[0].block_dim,
            "num_outer": self.layers[0].num_outer,
            "dtype": self.layers[0].dtype,
        }


def _block_dim(name: str, tensor: torch.Tensor, num_blocks: int) -> int:
    for dim in (0, 1):
        if tensor.dim() > dim and tensor.shape[dim] == num_blocks:
            return dim
    raise ValueError(
        f"cannot find the block dimension of layer {name}: shape {tuple(tensor.shape)}, "
        f"num_blocks {num_blocks}"
    )


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """Split (src, dst) block lists into (src_start, dst_start, length) runs that
    are consecutive on both sides."""
    if len(src) != len(dst):
        raise ValueError(f"block lists differ in length: {len(src)} vs {len(dst)}")
    out: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if out and s == out[-1][0] + out[-1][2] and d == out[-1][1] + out[-1][2]:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def chunk_views(
    kv_caches: Sequence[torch.Tensor],
    layout: KVLayout,
    runs: Sequence[tuple[int, int]],
) -> Iterator[torch.Tensor]:
    """Chunks for explicit (start, length) runs, in wire order (layer, outer, run)."""
    for tensor, lay in zip(kv_caches, layout.layers, strict=True):
        outer = tensor.reshape(lay.num_outer, *tensor.shape[lay.block_dim :])
        for o in range(lay.num_outer):
            for start, length in runs:
                yield outer[o, start : start + length]


def as_bytes(chunk: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor (any dtype, bf16 included)."""
    if not chunk.is_contiguous():
        raise ValueError("KV chunk is not contiguous; this layout needs a staging copy")
    return chunk.view(torch.uint8).numpy().data.cast("B")


def block_views(kv_caches: Sequence[torch.Tensor], layout: KVLayout,
                block_id: int) -> list[torch.Tensor]:
    """One block of every layer, a view each (the layer's shape without its block dim;
    not contiguous where the block dim is not the first): what a block codec reads and
    writes."""
    return [t.select(lay.block_dim, block_id)
            for t, lay in zip(kv_caches, layout.layers, strict=True)]
