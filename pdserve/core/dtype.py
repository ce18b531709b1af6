"""What ``--dtype auto`` means here, decided in one place for every command (``up``,
``prefill``/``decode`` workers, ``bench run|compare``), so that every engine of a run
and every baseline runs the same dtype and says why.

- CPU with native bf16 (AVX512_BF16, AMX-BF16, aarch64 BF16): ``bfloat16``, what vLLM's
  CPU backend picks for ``auto`` and its fast path there.
- CPU without it: ``float32``. vLLM would still pick bf16, which those CPUs emulate
  (prefill about twice as slow as float32, measured on AVX2-only and AVX-512 CPUs).
- CUDA: vLLM's own rule (``vllm.config.model._resolve_auto_dtype``): the model's
  ``torch_dtype``, with float32 checkpoints downcast to bfloat16 (float16 where the
  device lacks bf16).
An explicit dtype is kept as given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypeGuard, get_args

from pdserve.core.hardware import Hardware

EngineDtype = Literal["float32", "bfloat16", "float16"]  # vLLM's --dtype, as engines run it
DTYPES = ("auto", *get_args(EngineDtype))


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype engines run (never ``auto``), what was asked, and why."""

    requested: str
    dtype: EngineDtype
    reason: str
    hardware: Hardware

    def describe(self) -> str:
        """One line for start-up output and reports."""
        return (f"dtype {self.dtype} (requested {self.requested}: {self.reason}); "
                f"CPU {self.hardware.describe()}")


def resolve_dtype(requested: str = "auto", hardware: Hardware | None = None,
                  model_path: str | Path | None = None,
                  cuda_bf16: bool | None = None) -> DtypeChoice:
    """``requested`` as the engines will run it on ``hardware`` (this machine by
    default). ``model_path`` (its ``config.json``) matters only on CUDA."""
    if _is_engine_dtype(requested):
        return DtypeChoice(requested, requested, "as requested", hardware or Hardware.detect())
    if requested != "auto":
        raise ValueError(f"unknown dtype {requested!r}; valid: {', '.join(DTYPES)}")
    hw = hardware or Hardware.detect()
    if hw.cuda:
        return _cuda_choice(hw, model_path, cuda_bf16)
    if hw.native_bf16:
        return DtypeChoice(requested, "bfloat16",
                           f"native bf16 on this CPU ({', '.join(hw.bf16_flags)})", hw)
    return DtypeChoice(requested, "float32",
                       "no native bf16 on this CPU (no avx512_bf16/amx_bf16): "
                       "bf16 would be emulated", hw)


def _cuda_choice(hw: Hardware, model_path: str | Path | None,
                 cuda_bf16: bool | None) -> DtypeChoice:
    if cuda_bf16 is None:
        import torch

        cuda_bf16 = bool(torch.cuda.is_bf16_supported())
    preferred: EngineDtype = "bfloat16" if cuda_bf16 else "float16"
    config = _model_dtype(model_path)
    if (_is_engine_dtype(config) and config != "float32"
            and (config != "bfloat16" or cuda_bf16)):
        return DtypeChoice("auto", config, f"CUDA: the model's {config}", hw)
    return DtypeChoice("auto", preferred,
                       f"CUDA: the model's {config or 'unknown dtype'} as {preferred}", hw)


def _is_engine_dtype(name: str | None) -> TypeGuard[EngineDtype]:
    """Whether ``name`` is a dtype engines run (not ``auto``, not unknown)."""
    return name in get_args(EngineDtype)


def _model_dtype(model_path: str | Path | None) -> str | None:
    if model_path is None:
        return None
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    value = config.get("torch_dtype") or config.get("dtype")
    return str(value).removeprefix("torch.") if value else None
