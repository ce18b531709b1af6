"""pdserve's chained block hash: the name of a KV block in the router's prefix index.

Block ``i`` of a token sequence hashes its ``block_size`` token ids together with
the hash of block ``i - 1`` (0 before the first), so one hash names a whole
prefix. Workers translate vLLM's KV events into these hashes (from the token ids
the events carry) and the router hashes prompts the same way; neither depends on
vLLM's internal hash function. Only full blocks are hashed, as vLLM caches only
full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from hashlib import blake2b

import numpy as np

ROOT_HASH = 0


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of one block of ``token_ids`` whose preceding block hashed to ``parent``."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(np.asarray(token_ids, dtype=np.uint32).tobytes())
    return int.from_bytes(h.digest(), "little")


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
                 ) -> list[int]:
    """Hashes of every full block of ``token_ids``, chained from ``parent``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, not {block_size}")
    arr = np.asarray(token_ids, dtype=np.uint32)
    hashes: list[int] = []
    for start in range(0, len(arr) - block_size + 1, block_size):
        h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(arr[start:start + block_size].tobytes())
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes
