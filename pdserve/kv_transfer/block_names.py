"""Whether vLLM's prefix-cache hashes name one KV block each: what the tiers, the pool and
the cluster store need, since they address blocks by those hashes (or by pdserve's
hashes of the same token runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def hashes_name_blocks(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str:
    """Why a block's prefix-cache hash does not name one KV block ("" if it does):
    the tiers and the pool address blocks by those hashes."""
    block_size = vllm_config.cache_config.block_size
    if kv_cache_config.hash_block_size not in (None, block_size):
        return (f"prefix-cache hashes cover {kv_cache_config.hash_block_size} tokens, "
                f"blocks {block_size}")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or type(groups[0].kv_cache_spec).__name__ != "FullAttentionSpec":
        return "only one group of full attention is supported"
    return ""
