"""The machine's facts that decide how engines run here: the CPU's model, the flags
that decide its speed (native bf16 above all), the cores this process may use, and
whether a CUDA device is present. Read once from ``/proc/cpuinfo`` (or given, in tests).
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

# The flags a benchmark report shows (has / lacks).
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
# x86: AVX512_BF16 (Cooper Lake, Zen 4/5) or AMX-BF16 (Sapphire Rapids and later);
# aarch64: the BF16 extension ("bf16" in Features). Without one, bf16 is emulated.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
CPUINFO = Path("/proc/cpuinfo")
DEV = Path("/dev")
# NVIDIA (nvidia0, nvidiactl; Jetson's nvhost-*, nvmap), AMD ROCm (kfd), WSL 2 (dxg).
GPU_NODE_PREFIXES = ("nvidia", "nvhost", "nvmap")
GPU_NODES = frozenset({"kfd", "dxg"})


@dataclass(frozen=True)
class Hardware:
    cpu_model: str
    cpu_flags: frozenset[str]
    cores: tuple[int, ...]
    cuda: bool = False

    @property
    def native_bf16(self) -> bool:
        return any(f in self.cpu_flags for f in NATIVE_BF16_FLAGS)

    @property
    def bf16_flags(self) -> tuple[str, ...]:
        """The native-bf16 flags this CPU has (none: bf16 is emulated)."""
        return tuple(f for f in NATIVE_BF16_FLAGS if f in self.cpu_flags)

    def flag_table(self) -> dict[str, bool]:
        return {f: f in self.cpu_flags for f in REPORTED_FLAGS}

    def describe(self) -> str:
        """One line: model, cores and the flags that decide the dtype."""
        flags = " ".join(f"{'+' if has else '-'}{f}" for f, has in self.flag_table().items())
        return f"{self.cpu_model}, {len(self.cores)} cores; {flags}"

    @classmethod
    def from_cpuinfo(cls, text: str, cores: tuple[int, ...] = (), cuda: bool = False
                     ) -> Hardware:
        """From ``/proc/cpuinfo``'s text: the first processor's model and flags (x86
        ``flags``, aarch64 ``Features``)."""
        model, flags = "", frozenset[str]()
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip().lower()
            if key == "model name" and not model:
                model = value.strip()
            elif key in ("flags", "features") and not flags:
                flags = frozenset(value.split())
        return cls(model or platform.processor() or "unknown", flags, cores, cuda)

    @classmethod
    def detect(cls) -> Hardware:
        """This machine (imports torch to ask about CUDA when it is installed)."""
        try:
            text = CPUINFO.read_text()
        except OSError:
            text = ""
        return cls.from_cpuinfo(text, tuple(sorted(os.sched_getaffinity(0))), _cuda())


def _cuda() -> bool:
    import importlib.util

    if importlib.util.find_spec("torch") is None or not gpu_device_nodes():
        return False
    import torch

    return bool(torch.cuda.is_available())


def gpu_device_nodes(dev: Path | None = None) -> list[str]:
    """The device nodes through which CUDA (or ROCm, which torch also calls CUDA) reaches a
    GPU. Without one torch finds no CUDA device, so it is not imported to ask (~1 s of
    CPU at every start of a process that only reports the machine, e.g. ``pdserve
    bench run``)."""
    try:
        names = sorted(p.name for p in (dev or DEV).iterdir())
    except OSError:
        return ["?"]  # cannot tell: ask torch
    return [n for n in names if n.startswith(GPU_NODE_PREFIXES) or n in GPU_NODES]
