"""A worker's store identity from its registered KV caches: every layout change, TP rank
and salt gives other keys; the same layout on another device the same ones."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.identity import identity_for, with_salt
from pdserve.kv_transfer.remote.names import KVIdentity

BLOCKS = 6


def _identity(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, layers: int = 2,
              block_size: int = 16, tp_rank: int = 0, tp_size: int = 1,
              compression: str = "none") -> KVIdentity:
    caches = {f"layer.{i}": torch.zeros(shape, dtype=dtype) for i in range(layers)}
    layout = KVLayout.from_kv_caches(caches, BLOCKS, block_size)
    return identity_for(layout, model_fingerprint="fp", weight_version="default",
                        tp_rank=tp_rank, tp_size=tp_size, compression=compression)


CPU = (BLOCKS, 2, 16, 128)  # (blocks, heads, tokens, 2 * head_dim)


def test_the_layout_names_dtype_shape_block_dim_and_rank() -> None:
    base = _identity(CPU)
    assert base.kv_dtype == "float32" and base.block_size == 16
    assert base.block_shape == (2, 2, 16, 128)
    others = [_identity(CPU, torch.bfloat16), _identity((BLOCKS, 4, 16, 64)),
              _identity((2, BLOCKS, 16, 2, 64)), _identity((BLOCKS, 2, 16, 64, 2)),
              _identity(CPU, layers=3), _identity(CPU, block_size=32),
              _identity(CPU, tp_rank=1, tp_size=2), _identity(CPU, tp_rank=0, tp_size=2),
              with_salt(base, "tenant-a"), with_salt(base, ""),
              *(_identity(CPU, compression=c) for c in ("lossless", "int8", "fp8"))]
    keys = {ident.names([7])[0].key for ident in [base, *others]}
    assert len(keys) == 1 + len(others)
    assert _identity(CPU).names([7])[0].key == base.names([7])[0].key  # deterministic


def test_the_codec_is_part_of_the_identity() -> None:
    assert _identity(CPU).kv_encoding == "none"
    assert _identity(CPU, compression="int8").kv_encoding == "int8.v1"
    with pytest.raises(ValueError, match="unknown KV compression"):
        _identity(CPU, compression="zip")


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        _identity(CPU, tp_rank=2, tp_size=2)
