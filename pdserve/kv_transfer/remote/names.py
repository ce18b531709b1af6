"""A KV block's name in the cluster store: everything that decides its bytes, hashed.

A block's bytes depend on the model's weights (the checkpoint's content fingerprint,
``tiers/fingerprint.py``, and the weight version vLLM reports after an update), the LoRA
adapter (its name and folder: ``core.lora.LoraAdapter.tag``), the request's
``cache_salt`` (its tenant), the KV cache's dtype and layout (layout name, tokens per
block, one block's shape), how the store encodes it (``--kv-compression``: a lossy block
is not the raw one), and the tokens of the block and of every block before it
(``core.block_hash``'s chained hash). A ``BlockName`` holds all of them; its key is
``pdserve:kv:v1:{TAG}DIGEST`` where DIGEST is a 128-bit BLAKE2b of every field in a
canonical JSON encoding (``None`` and ``""`` differ, no separator can be forged), so two
names that differ in any field never share a key (a collision needs a 128-bit hash
collision).

The ``{TAG}`` is Redis Cluster's hash tag: only it decides the key's slot. It hashes the
identity and the prompt's *first* block hash (``root_hash``), so every block of one
prompt lives on one shard and one pipeline reaches them all (``lookup_prefix`` is one
round trip in cluster mode too). That keeps content addressing: a chained hash already
fixes every block before it, the first one included, so the same block always gets the
same tag whichever prompt names it. The cost: prompts sharing a first block (one long
system prompt) share a shard; spreading them would cost a round trip per shard.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import blake2b

KEY_PREFIX = "pdserve:kv:v1:"


@dataclass(frozen=True)
class KVIdentity:
    """What a worker's KV bytes depend on beyond the tokens: one per model, weights,
    adapter, tenant and cache format."""

    model_fingerprint: str  # tiers/fingerprint.checkpoint_fingerprint (the files' hash)
    weight_version: str  # vLLM's weight version ("default" until an update)
    kv_dtype: str  # e.g. "bfloat16", "float32", "fp8_e4m3"
    kv_layout: str  # the layout's name, e.g. "cpu" or "flash_attn"
    block_size: int  # tokens per block
    block_shape: tuple[int, ...] = ()  # one block's shape (layers, heads, ...)
    cache_salt: str | None = None  # the request's salt: its tenant
    adapter: str | None = None  # a LoRA adapter's tag: its name and folder (core.lora)
    # how the block's bytes are encoded in the store (``compression.encoding_tag``:
    # "none", "lossless.v1", "int8.v1", "fp8.v1"): workers with other settings never
    # share a block
    kv_encoding: str = "none"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, not {self.block_size}")

    def canonical(self) -> list[object]:
        return [self.model_fingerprint, self.weight_version, self.kv_dtype, self.kv_layout,
                self.block_size, list(self.block_shape), self.cache_salt, self.adapter,
                self.kv_encoding]

    def names(self, block_hashes: Sequence[int]) -> list[BlockName]:
        """The names of one prompt's blocks (its chained hashes, first block first)."""
        if not block_hashes:
            return []
        root = block_hashes[0]
        return [BlockName(self, h, root) for h in block_hashes]


@dataclass(frozen=True)
class BlockName:
    identity: KVIdentity
    block_hash: int  # core.block_hash chained hash of this block (a 64-bit int)
    root_hash: int  # the chained hash of the prompt's first block (the shard tag)
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ident = self.identity.canonical()
        tag = _digest([ident, self.root_hash], 8)
        digest = _digest([ident, self.block_hash, self.root_hash], 16)
        object.__setattr__(self, "key", f"{KEY_PREFIX}{{{tag}}}{digest}")


def _digest(fields: list[object], size: int) -> str:
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=True)
    return blake2b(text.encode(), digest_size=size, person=b"pdserve-kv-v1").hexdigest()
