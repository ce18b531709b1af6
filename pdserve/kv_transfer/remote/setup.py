"""The cluster KV store's two sides of the connector, built from its settings: the
scheduler side's ``StorePlanner`` and the worker side's ``StoreWorker``, or None where
the store is off (no ``--kv-store``) or cannot serve this engine:

- several tensor-parallel ranks: each holds its own heads, so one block would be one
  value per rank, and a lookup would have to agree across ranks (not built);
- prefix-cache hashes that do not name one KV block (hybrid or sliding-window
  attention), as for the tiers and the pool.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pdserve.kv_transfer.block_names import hashes_name_blocks
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.admission import StoreAdmission
from pdserve.kv_transfer.remote.base import KVStore, create_store
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.remote.decision import FetchDecision
from pdserve.kv_transfer.remote.engine_identity import engine_identity
from pdserve.kv_transfer.remote.kv_format import attention_backend, layer_backends
from pdserve.kv_transfer.remote.names import KVIdentity
from pdserve.kv_transfer.remote.plan import StorePlanner
from pdserve.kv_transfer.remote.worker import StoreWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("pdserve.kv_transfer.store")


def _why_off(config: ConnectorConfig, vllm_config: VllmConfig,
             kv_cache_config: KVCacheConfig) -> str:
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
        return "tensor or pipeline parallelism (one value per rank is not built)"
    if kv_cache_config.kv_cache_groups and _named_backend(vllm_config, kv_cache_config) is None:
        return "vLLM's attention backend selector did not answer (the blocks' names need it)"
    if not kv_cache_config.num_blocks:
        return "no KV cache"
    return hashes_name_blocks(vllm_config, kv_cache_config)


def _identity(config: ConnectorConfig, vllm_config: VllmConfig,
              kv_cache_config: KVCacheConfig) -> KVIdentity | None:
    if not config.kv_store:
        return None
    why = _why_off(config, vllm_config, kv_cache_config)
    if why:
        logger.warning("KV store off: %s", why)
        return None
    return engine_identity(vllm_config, kv_cache_config, config.kv_compression,
                           config.kv_disk_dir)


def _named_backend(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return attention_backend(vllm_config, int(getattr(spec, "head_size", 0)))


def _opener(config: ConnectorConfig) -> Callable[[], KVStore]:
    url = config.kv_store
    assert url is not None  # only called with a store
    options = config.store_options()
    return lambda: create_store(url, options)


def store_planner(config: ConnectorConfig, vllm_config: VllmConfig,
                  kv_cache_config: KVCacheConfig) -> StorePlanner | None:
    identity = _identity(config, vllm_config, kv_cache_config)
    if identity is None:
        return None
    block_bytes = (sum(t.size for t in kv_cache_config.kv_cache_tensors)
                   // kv_cache_config.num_blocks)
    decision = FetchDecision(block_bytes=block_bytes, block_size=identity.block_size)
    logger.info("KV store %s: blocks of %d bytes, published for %.0f s, admission %s",
                config.kv_store, block_bytes, config.kv_store_ttl_s,
                config.kv_store_admission)
    return StorePlanner(_opener(config), identity, identity.block_size, decision,
                        config.kv_store_ttl_s, block_bytes,
                        StoreAdmission.named(config.kv_store_admission))


def store_worker(config: ConnectorConfig, vllm_config: VllmConfig,
                 kv_cache_config: KVCacheConfig
                 ) -> Callable[[list[torch.Tensor], KVLayout], StoreWorker | None] | None:
    """The worker side's store, built once vLLM registered the caches: None (the store
    off on this worker: its loads are computed, nothing is published) where the model's
    attention layers use another backend than the blocks' names say (the scheduler side
    names them by what vLLM's selector answers for this config)."""
    identity = _identity(config, vllm_config, kv_cache_config)
    if identity is None:
        return None
    opener = _opener(config)
    group = kv_cache_config.kv_cache_groups[0]
    named = _named_backend(vllm_config, kv_cache_config)

    def build(kv: list[torch.Tensor], layout: KVLayout) -> StoreWorker | None:
        used = layer_backends(vllm_config, list(group.layer_names))
        if not used or used != {named}:  # none found: nothing proves the names right
            logger.warning("KV store off on this worker: its attention layers use %s, the "
                           "blocks' names say %s", sorted(used), named)
            return None
        return StoreWorker(opener, kv, layout, codec_for(config.kv_compression, layout),
                           config.kv_store_ttl_s)

    return build
