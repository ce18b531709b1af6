"""Small random LoRA adapters for the default model, written by hand in PEFT's layout
(``adapter_config.json`` + ``adapter_model.safetensors``), no ``peft`` needed: rank
``rank`` on every layer's ``q_proj`` and ``v_proj``, ``lora_B`` non-zero so that the
adapter changes the output. ``pdserve bench rollout-lora`` refits between such adapters;
the LoRA tests make theirs here too (``tests/lora_adapters.py`` re-exports this)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TARGETS = ("q_proj", "v_proj")


def _shapes(config: dict[str, object]) -> dict[str, tuple[int, int]]:
    hidden = _int(config, "hidden_size")
    heads = _int(config, "num_attention_heads")
    kv_heads = _int(config, "num_key_value_heads", heads)
    head_dim = _int(config, "head_dim", hidden // heads)
    return {"q_proj": (hidden, heads * head_dim), "v_proj": (hidden, kv_heads * head_dim)}


def _int(config: dict[str, object], key: str, default: int | None = None) -> int:
    """``config[key]`` (``default`` where absent), which must be an integer."""
    value = config.get(key, default)
    if not isinstance(value, int):
        raise ValueError(f"config.json: {key} is {value!r}, not an integer")
    return value


def make_adapter(model_path: str | Path, dest: str | Path, seed: int, rank: int = 8,
                 scale: float = 0.05) -> Path:
    """Write a random adapter for the model at ``model_path`` into ``dest``."""
    config = json.loads((Path(model_path) / "config.json").read_text())
    shapes = _shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(int(config["num_hidden_layers"])):
        for target in TARGETS:
            fan_in, fan_out = shapes[target]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(
                rank, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(
                fan_out, rank, generator=gen) * scale
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "lora_dropout": 0.0, "target_modules": list(TARGETS), "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "base_model_name_or_path": str(model_path)}))
    return out
