"""How one engine lays its KV bytes out, beyond the dtype and the block size: the part of
a stored block's identity (``KVIdentity.kv_layout``) that two workers of one model can
still disagree on.

- the device type (a CPU cache is ``(blocks, heads, tokens, 2 * head_dim)``, a CUDA one
  ``(2, blocks, tokens, heads, head_dim)``: the same spec, other bytes);
- the attention backend vLLM picks for the model's layers (``CPU_ATTN``, ``FLASH_ATTN``,
  ``FLASHINFER``...: each has its own cache shape), as its selector answers for this
  config, on both connector sides (``attention_backend``);
- the KV cache layout vLLM resolved for the whole engine (``KVCacheLayout``: ``LBNHC``,
  the old NHD, or ``LBHNC``, HND, ...);
- the attention spec with every field (heads, head sizes, dtype, quantization, padding);
- the number of cache tensors (layers), the bytes of one block, the TP size, and vLLM's
  version (a release may lay the same spec out otherwise).

``name()`` keeps the readable parts and hashes them all, so two formats that differ in
any field never give one name.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from hashlib import blake2b
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("pdserve.kv_transfer.store")


@dataclass(frozen=True)
class KVFormat:
    device: str  # "cpu", "cuda"
    attention_backend: str  # vLLM's backend name, e.g. "CPU_ATTN", "FLASH_ATTN"
    cache_layout: str  # vLLM's resolved KVCacheLayout name, e.g. "LBNHC" (NHD)
    spec: str  # the attention spec: its class and every field (``describe_spec``)
    num_tensors: int
    block_bytes: int
    tp_size: int = 1
    vllm: str = ""

    def name(self) -> str:
        fields = json.dumps(dataclasses.astuple(self), separators=(",", ":"))
        digest = blake2b(fields.encode(), digest_size=8).hexdigest()
        return (f"{self.device}:{self.attention_backend}:{self.cache_layout}:"
                f"layers{self.num_tensors}:bytes{self.block_bytes}:tp{self.tp_size}:{digest}")


def describe_spec(spec: object) -> str:
    """A KV cache spec's class and every field's value, in a stable text."""
    if not dataclasses.is_dataclass(spec) or isinstance(spec, type):
        return repr(spec)
    values = ",".join(f"{f.name}={getattr(spec, f.name)!r}" for f in dataclasses.fields(spec))
    return f"{type(spec).__name__}({values})"


def cache_layout(vllm_config: VllmConfig, resolved: str | None) -> str:
    """vLLM's resolved KV cache layout (the KV cache config's, else the cache config's)."""
    return resolved or vllm_config.cache_config.kv_cache_layout or "unresolved"


def attention_backend(vllm_config: VllmConfig, head_size: int) -> str | None:
    """The backend vLLM's selector picks for a decoder full-attention layer of this
    engine (its name); None where the selector cannot answer here (the store is then off:
    a guessed name could let two layouts of the same shape share blocks)."""
    try:
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend

        model = vllm_config.model_config
        dtype = model.dtype
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"the model's dtype {dtype!r} is not resolved")
        with set_current_vllm_config(vllm_config):
            backend = get_attn_backend(head_size, dtype,
                                       vllm_config.cache_config.cache_dtype,
                                       use_mla=model.use_mla)
        return str(backend.get_name())
    except Exception as exc:  # noqa: BLE001 - any failure turns the store off, never the engine
        logger.warning("KV store: vLLM's attention backend selector did not answer: %s", exc)
        return None


def layer_backends(vllm_config: VllmConfig, layer_names: list[str]) -> set[str]:
    """The backends the worker's attention layers actually use (their names), from the
    forward context vLLM built; empty where it holds none of them."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    context = vllm_config.compilation_config.static_forward_context
    return {str(layer.get_attn_backend().get_name()) for name in layer_names
            if isinstance(layer := context.get(name), AttentionLayerBase)}
