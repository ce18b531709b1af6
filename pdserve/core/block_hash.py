"""pdserve's chained block hash: the name of a KV block in the router's prefix index.

Block ``i`` of a token sequence hashes its ``block_size`` token ids together with
the hash of block ``i - 1`` (0 before the first), so one hash names a whole
prefix. Workers translate vLLM's KV events into these hashes (from the token ids
the events carry) and the router hashes prompts the same way; neither depends on
vLLM's internal hash function. Only full blocks are hashed, as vLLM caches only
full blocks. A request's ``cache_salt`` chains its first block from ``salt_root(salt)``
instead of 0, so prefixes under different salts never share a name.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from hashlib import blake2b

ROOT_HASH = 0
# vLLM's name for the weights an engine started with (``EngineCore._weight_version``).
DEFAULT_WEIGHT_VERSION = "default"
_U32 = next(code for code in "IL" if array(code).itemsize == 4)  # token ids as uint32


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    return array(_U32, token_ids).tobytes()  # ~3x faster than numpy for a list


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The hash of one block of ``token_ids`` whose preceding block hashed to ``parent``."""
    h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
    h.update(_token_bytes(token_ids))
    return int.from_bytes(h.digest(), "little")


def salt_root(cache_salt: str | None) -> int:
    """The parent of a prompt's first block under ``cache_salt`` (``ROOT_HASH`` without
    one): every block name of a salted prompt differs from the same tokens' unsalted or
    otherwise salted ones, as vLLM's own block hashes do (it hashes the salt into the
    first block)."""
    if cache_salt is None:
        return ROOT_HASH
    digest = blake2b(b"pdserve-cache-salt:" + cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def versioned_salt(cache_salt: str | None, weight_version: str) -> str | None:
    """The salt a request's KV is cached under while the cluster serves
    ``weight_version``: the request's own until the first weight update (vLLM's
    ``"default"`` version), then the version joined to it. So KV computed under other
    weights never shares a block name with this version's: not in an engine's prefix
    cache, a KV tier, the pool or the router's index. ``@`` joins them: a client's own
    salt may not hold it, so no client can name another version's blocks."""
    if weight_version == DEFAULT_WEIGHT_VERSION:
        return cache_salt
    return f"{cache_salt or ''}@weights:{weight_version}"


def chain_hashes(token_ids: Sequence[int], block_size: int, parent: int = ROOT_HASH
                 ) -> list[int]:
    """Hashes of every full block of ``token_ids``, chained from ``parent``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be > 0, not {block_size}")
    data, step = _token_bytes(token_ids), 4 * block_size
    hashes: list[int] = []
    for start in range(0, len(token_ids) // block_size * step, step):
        h = blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(data[start:start + step])
        parent = int.from_bytes(h.digest(), "little")
        hashes.append(parent)
    return hashes


# A block held in a worker's KV tier rather than its engine's cache travels in the same
# KV-event stream and prefix index under the block's hash in the tier's own namespace:
# the hash XOR a fixed 64-bit mask per tier. One stream, one seq and one snapshot cover
# the engine and its tiers; a reader asks for a tier by masking the prompt's hashes.
# ``store``: the blocks a worker published to the cluster KV store (``--kv-store``),
# loadable by every worker on that store, not only the one that announced them.
KV_TIERS = ("host", "disk", "store")
STORE_TIER = "store"
_TIER_MASK = {tier: int.from_bytes(blake2b(f"pdserve-kv-tier:{tier}".encode(),
                                           digest_size=8).digest(), "little")
              for tier in KV_TIERS}


def tier_hashes(hashes: Sequence[int], tier: str) -> list[int]:
    """``hashes`` in ``tier``'s namespace (``tier`` one of ``KV_TIERS``)."""
    mask = _TIER_MASK[tier]
    return [h ^ mask for h in hashes]
