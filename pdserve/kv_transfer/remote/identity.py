"""A worker's ``KVIdentity`` from what its connector knows: the KV caches vLLM registered
(``KVLayout``), its tensor-parallel rank, the checkpoint's fingerprint and the weights'
version, and the store's codec (``--kv-compression``); the request adds its salt
(``with_salt``).

The layout part names what decides a block's bytes and nothing else: each layer's dtype,
its shape without the block dimension, and where the block dimension is (a CPU cache
``(blocks, heads, tokens, 2 * head_dim)`` and a CUDA one ``(2, blocks, tokens, heads,
head_dim)`` differ there), and the TP rank and size (each rank holds its own heads). Not
the device: the same shape and dtype are the same bytes on a CPU and a GPU.
"""

from __future__ import annotations

import dataclasses
import json
from hashlib import blake2b

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression import encoding_tag
from pdserve.kv_transfer.remote.names import KVIdentity


def identity_for(layout: KVLayout, *, model_fingerprint: str, weight_version: str,
                 tp_rank: int = 0, tp_size: int = 1, adapter: str | None = None,
                 compression: str = "none") -> KVIdentity:
    """The identity of this rank's blocks, without a salt (``with_salt`` adds one);
    ``compression``: the store's codec (``--kv-compression``), part of the identity."""
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
    layers = [[lay.dtype, _block_shape(lay.shape, lay.block_dim), lay.block_dim]
              for lay in layout.layers]
    digest = blake2b(json.dumps(layers, separators=(",", ":")).encode(),
                     digest_size=8).hexdigest()
    first = layout.layers[0]
    return KVIdentity(
        model_fingerprint=model_fingerprint, weight_version=weight_version,
        kv_dtype=",".join(sorted({lay.dtype for lay in layout.layers})),
        kv_layout=f"tp{tp_rank}of{tp_size}:layers{len(layers)}:{digest}",
        block_size=layout.block_size,
        block_shape=(len(layers), *_block_shape(first.shape, first.block_dim)),
        adapter=adapter, kv_encoding=encoding_tag(compression))


def with_salt(identity: KVIdentity, cache_salt: str | None) -> KVIdentity:
    """``identity`` for a request salted with ``cache_salt`` (its tenant)."""
    return dataclasses.replace(identity, cache_salt=cache_salt)


def _block_shape(shape: tuple[int, ...], block_dim: int) -> tuple[int, ...]:
    return shape[:block_dim] + shape[block_dim + 1:]
