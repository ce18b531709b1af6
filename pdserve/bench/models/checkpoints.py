"""Checkpoints for weight-update benches and tests: a copy of a safetensors model folder
whose weights are perturbed, so that an update to it visibly changes what the model says.

An RL loop pushes a new checkpoint after every training step; the benches stand in for
training with ``perturb_checkpoint``: every floating tensor gets seeded Gaussian noise of
``scale`` times its own standard deviation (relative, so layer norms and embeddings are
moved alike), everything else in the folder (config, tokenizer, generation config) is
copied unchanged. The same source, scale and seed give the same bytes: each tensor's noise
comes from a generator seeded by ``seed`` and the tensor's name, not from the order the
tensors are read in, and the arithmetic runs on one thread (whatever the machine's
cores: the bytes do not depend on a reduction's split). One thread is also the fast way
here: most tensors are small (576 x 576), and a pool of two threads waiting on each other
for each of them, beside engines that hold the cores, took 13-19 s for SmolLM2-135M on a
busy two-core machine where one thread takes 3.6 s. At the default scale
SmolLM2-135M-Instruct's greedy answer to an ordinary chat prompt departs from the
original's within its first 16 tokens and stays readable English.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

DEFAULT_SCALE = 0.05
# The model cache's completion marker (pdserve.core.model) vouches for the source's
# conversion; it must not vouch for a perturbed copy, so hidden files are not copied.
_HIDDEN = "."


def perturb_checkpoint(src: Path, dst: Path, *, scale: float = DEFAULT_SCALE,
                       seed: int = 0) -> Path:
    """Write ``src`` (a HF model folder with ``*.safetensors``) to ``dst`` with every
    floating tensor ``t`` replaced by ``t + scale * std(t) * N(0, 1)``; returns ``dst``.

    Raises ``ValueError`` if ``src`` holds no ``*.safetensors``, if ``dst`` exists and is
    not an empty folder, or if ``scale`` is negative. ``dst`` appears whole or not at
    all: the copy is built in a sibling temporary folder and renamed into place."""
    src, dst = Path(src), Path(dst)
    weights = _weight_files(src)
    _check_destination(dst)
    if not scale >= 0:
        raise ValueError(f"scale must be >= 0, not {scale}")
    dst.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    threads = torch.get_num_threads()
    try:
        _copy_others(src, staging)
        torch.set_num_threads(1)
        for path in weights:
            _perturb_file(path, staging / path.name, scale, seed)
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.replace(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    return dst


def _weight_files(src: Path) -> list[Path]:
    if not src.is_dir():
        raise ValueError(f"checkpoint source {src} is not a directory")
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise ValueError(f"checkpoint source {src} holds no *.safetensors file (only "
                         "safetensors model folders can be perturbed)")
    return weights


def _check_destination(dst: Path) -> None:
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"checkpoint destination {dst} already exists and is not an empty "
                         "directory; pick a new path or remove it")


def _copy_others(src: Path, dst: Path) -> None:
    """Every entry of ``src`` but the weights and hidden files, as it is."""
    for entry in sorted(src.iterdir()):
        if entry.name.startswith(_HIDDEN) or entry.suffix == ".safetensors":
            continue
        if entry.is_dir():
            shutil.copytree(entry, dst / entry.name)
        else:
            shutil.copy2(entry, dst / entry.name)


def _perturb_file(src: Path, dst: Path, scale: float, seed: int) -> None:
    with safe_open(str(src), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: perturb_tensor(f.get_tensor(name), name, scale, seed)
                   for name in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)
    save_file(tensors, str(dst), metadata=metadata)


def perturb_tensor(tensor: torch.Tensor, name: str, scale: float, seed: int) -> torch.Tensor:
    """``tensor`` plus noise of ``scale`` times its std (its magnitude when it has one
    element); integer and bool tensors (ids, masks) are returned as they are. The noise is
    drawn in float32 from a generator seeded by ``seed`` and ``name``."""
    if not tensor.is_floating_point() or scale == 0:
        return tensor
    values = tensor.float()
    spread = values.std() if values.numel() > 1 else values.abs().sum()
    # CPU generators keep 32 bits of a seed: fold the seed and the name into them.
    generator = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{name}".encode()))
    noise = torch.randn(values.shape, generator=generator, dtype=torch.float32)
    return (values + noise * (scale * float(spread))).to(tensor.dtype).contiguous()
