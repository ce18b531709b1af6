"""The cluster KV store's identity of one engine's blocks, from what vLLM tells the
connector, the same on its scheduler side and its worker side.

Both sides of the connector get vLLM's config and the KV cache's config before any
tensor exists, so the identity is built from those (the worker side's registered
tensors are not needed): the model's checkpoint fingerprint (its files' content,
``tiers/fingerprint.py``), the KV dtype and tokens per block, the KV format
(``kv_format.py``: the device type, the attention backend vLLM's selector picks, the KV
cache layout vLLM resolved, the attention spec with every field, the number of cache
tensors, the bytes of one block, the TP size, vLLM's version), and the encoding of the
stored values (``--kv-compression``).

A request adds its ``cache_salt``. pdserve caches a request under its *versioned* salt
(``core.block_hash.versioned_salt``: the tenant's salt, then ``@weights:`` and the
version after the first weight update; before it, ``@lora:`` and the LoRA adapter's tag
when the request runs one: ``core.lora.adapter_salt``), so ``for_request`` splits it: the
weight version, the adapter and the tenant each get their own field of the name.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from vllm.version import __version__ as vllm_version

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.lora import split_adapter_salt
from pdserve.core.model import cache_dir
from pdserve.kv_transfer.remote.compression import encoding_tag
from pdserve.kv_transfer.remote.kv_format import (
    KVFormat,
    attention_backend,
    cache_layout,
    describe_spec,
)
from pdserve.kv_transfer.remote.names import KVIdentity
from pdserve.kv_transfer.tiers.fingerprint import checkpoint_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger("pdserve.kv_transfer.store")

_VERSION_MARK = "@weights:"


def engine_identity(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig,
                    encoding: str, fingerprint_dir: str | None) -> KVIdentity:
    """This engine's blocks' identity, without a salt (``for_request`` adds one)."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    num_tensors = len(kv_cache_config.kv_cache_tensors)
    heads = int(getattr(spec, "num_kv_heads", 0))
    head_size = int(getattr(spec, "head_size", 0))
    dtype = str(getattr(spec, "dtype", vllm_config.model_config.dtype)).removeprefix("torch.")
    model = str(vllm_config.model_config.model)
    return KVIdentity(
        model_fingerprint=checkpoint_fingerprint(model, fingerprint_dir or _cache_dir())
        or f"name:{model}",
        weight_version=DEFAULT_WEIGHT_VERSION, kv_dtype=dtype,
        kv_layout=engine_format(vllm_config, kv_cache_config).name(),
        block_size=vllm_config.cache_config.block_size,
        block_shape=(num_tensors, heads, head_size), kv_encoding=encoding_tag(encoding))


def engine_format(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> KVFormat:
    """How this engine lays its KV bytes out (``kv_format.py``)."""
    spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
    return KVFormat(
        device=str(vllm_config.device_config.device_type),
        # never None here: the store is off where the selector cannot answer (setup.py)
        attention_backend=attention_backend(
            vllm_config, int(getattr(spec, "head_size", 0))) or "unknown",
        cache_layout=cache_layout(vllm_config, kv_cache_config.kv_cache_layout),
        spec=describe_spec(spec), num_tensors=len(kv_cache_config.kv_cache_tensors),
        block_bytes=(sum(t.size for t in kv_cache_config.kv_cache_tensors)
                     // max(kv_cache_config.num_blocks, 1)),
        tp_size=vllm_config.parallel_config.tensor_parallel_size, vllm=vllm_version)


def for_request(identity: KVIdentity, versioned_salt: str | None) -> KVIdentity:
    """``identity`` for a request cached under ``versioned_salt`` (its tenant's salt, its
    LoRA adapter's tag and the weights' version, as vLLM saw it)."""
    salt, version = versioned_salt, DEFAULT_WEIGHT_VERSION
    if versioned_salt is not None and _VERSION_MARK in versioned_salt:
        tenant, _, version = versioned_salt.rpartition(_VERSION_MARK)
        salt = tenant or None
    salt, adapter = split_adapter_salt(salt)
    return dataclasses.replace(identity, cache_salt=salt, weight_version=version,
                               adapter=adapter)


def _cache_dir() -> str | None:
    """Where the checkpoint's file hashes are remembered without a disk tier:
    ``<cache>/kv-store`` (``PDSERVE_CACHE`` moves it, as it moves the models); None when
    that folder cannot be made (then they are hashed at each start: never a shared
    folder such as ``/tmp``, where another user could plant the hashes)."""
    folder = cache_dir() / "kv-store"
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        logger.warning("KV store: checkpoint hashes not kept (%s: %s); the model's files "
                       "are hashed at each start", folder, exc.strerror or exc)
        return None
    return str(folder)
