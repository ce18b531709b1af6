"""The two systems ``pdserve bench rollout-lora`` runs its loop against, as command lines
(building one starts nothing; the unit tests check them): ``pdserve up`` and one
aggregated ``vllm serve``, both from ``pdserve.bench.compare.systems`` (same model, dtype, KV
size, context, cores), each with the same LoRA flags, as ``vllm serve`` spells them.

vLLM serves the routes the loop needs only when asked: ``/v1/load_lora_adapter`` with
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``, ``/pause``, ``/resume`` and ``/is_paused`` with
``VLLM_SERVER_DEV_MODE=1`` (vLLM 0.32's ``entrypoints/rl/online``), all on its one port.
pdserve serves them on its admin listener (``--admin-port``).
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.bench.compare.systems import (
    EngineSettings,
    ProcSpec,
    SystemSpec,
    pdserve_up,
    vllm_aggregated,
)

VLLM_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1", "VLLM_SERVER_DEV_MODE": "1"}


@dataclass(frozen=True)
class LoraSettings:
    """The LoRA flags both systems get: the adapter served from the start
    (``--lora-modules name=first``), ``--max-loras``, ``--max-lora-rank``."""

    name: str
    first: Path
    max_loras: int
    max_rank: int

    def flags(self) -> list[str]:
        return ["--enable-lora", "--lora-modules", f"{self.name}={self.first}",
                "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_rank)]


@dataclass(frozen=True)
class LoraSystem:
    """A system to start, and where its OpenAI API and its admin routes answer."""

    spec: SystemSpec
    admin_url: str

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def url(self) -> str:
        return self.spec.base_url


def vllm_lora(s: EngineSettings, lora: LoraSettings, port: int) -> LoraSystem:
    """One ``vllm serve`` on every core, with LoRA and the runtime-update and dev routes."""
    base = vllm_aggregated(s, port)
    (proc,) = base.procs
    proc = ProcSpec(proc.name, (*proc.argv, *lora.flags()), {**proc.env, **VLLM_LORA_ENV})
    spec = replace(base, procs=(proc,), flags=shlex.join(lora.flags()))
    return LoraSystem(spec, spec.base_url)


def pdserve_lora(s: EngineSettings, lora: LoraSettings, port: int, admin_port: int,
                 command: Sequence[str] | None = None) -> LoraSystem:
    """``pdserve up`` with an admin listener on ``admin_port`` and the LoRA flags."""
    flags = shlex.join(["--admin-port", str(admin_port), *lora.flags()])
    spec = pdserve_up(s, port, "pdserve", flags, command)
    return LoraSystem(spec, f"http://127.0.0.1:{admin_port}")
