"""In-place weight updates inside vLLM's worker process: the methods vLLM adds to its
``Worker`` (``worker_extension_cls``), called by name through ``collective_rpc``.

An update is two calls, so that a cluster can switch all its workers or none:
``pdserve_stage_weights`` reads a checkpoint folder into host memory and checks it
against the served model's own checkpoint (every tensor present, nothing extra, same
shapes); nothing the engine uses changes, and a bad folder fails here.
``pdserve_commit_weights`` then copies the staged tensors into the model with vLLM's
``reload_weights`` (in place: the KV cache memory and the process stay) and drops the
staged copy. Staging holds one extra copy of the weights in host memory until the
commit or ``pdserve_discard_weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_STAGED = "_pdserve_staged_weights"


class StagingError(ValueError):
    """A checkpoint that cannot become the served model's weights."""


def checkpoint_files(folder: str | Path) -> list[Path]:
    """The folder's safetensors files, sorted; raises ``StagingError`` when there are none."""
    path = Path(folder)
    if not path.is_dir():
        raise StagingError(f"model_path {str(folder)!r} is not a directory on this worker")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise StagingError(f"model_path {str(folder)!r} holds no *.safetensors file")
    return files


def checkpoint_layout(folder: str | Path) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, read from the safetensors headers only (no tensor data)."""
    from safetensors import safe_open

    layout: dict[str, tuple[int, ...]] = {}
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                layout[name] = tuple(f.get_slice(name).get_shape())
    return layout


def layout_problem(new: dict[str, tuple[int, ...]], served: dict[str, tuple[int, ...]]
                   ) -> str | None:
    """Why a checkpoint with layout ``new`` cannot replace ``served`` (None: it can)."""
    missing = sorted(served.keys() - new.keys())
    extra = sorted(new.keys() - served.keys())
    if missing:
        return f"{len(missing)} tensors of the served model are missing, e.g. {missing[0]!r}"
    if extra:
        return f"{len(extra)} tensors are not in the served model, e.g. {extra[0]!r}"
    for name, shape in new.items():
        if shape != served[name]:
            return f"tensor {name!r} has shape {list(shape)}, the served model's is " \
                   f"{list(served[name])}"
    return None


def check_checkpoint(model_path: str | Path, served: str | Path) -> None:
    """Raises ``StagingError`` unless ``model_path`` can replace the ``served`` model's
    weights (reads the safetensors headers only)."""
    problem = layout_problem(checkpoint_layout(model_path), checkpoint_layout(served))
    if problem is not None:
        raise StagingError(f"{model_path}: {problem}")


def load_checkpoint(folder: str | Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(folder):
        tensors.update(load_file(str(file), device="cpu"))
    return tensors


def refresh_embedding_kernels(model: torch.nn.Module) -> int:
    """Re-run the post-load step of every vocabulary embedding and LM head; how many.

    On CPU that step builds the LM head's GEMM kernel from a packed copy of its weight.
    vLLM's in-place reload re-processes the layers it loaded, but a head tied to the
    embedding (SmolLM2, Llama 3.2, ...) loads nothing of its own, so it kept computing
    logits with the old weights' packed copy: output that matched neither version. The
    step keeps the weight (``remove_weight=False``), so running it again is safe, and a
    no-op where it packs nothing (GPUs)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    refreshed = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if isinstance(module, VocabParallelEmbedding) and method is not None:
            method.process_weights_after_loading(module)
            refreshed += 1
    return refreshed


class WeightsExtension:
    """Mixed into vLLM's ``Worker`` (``self`` is the worker: ``model_runner``,
    ``vllm_config``). Every method returns plain values (they cross processes)."""

    vllm_config: Any  # the Worker's
    model_runner: Any

    def pdserve_stage_weights(self, model_path: str, version: str) -> dict[str, Any]:
        """Read ``model_path`` into host memory under ``version``; raises ``StagingError``
        for a folder that is not the served model's layout (nothing is staged then)."""
        check_checkpoint(model_path, self.vllm_config.model_config.model)
        # A private copy, not the files' memory map (the folder may change before the
        # commit), in the engine's dtype as its first load casts them (a float32
        # checkpoint staged for a bf16 engine takes half the memory).
        dtype = self.vllm_config.model_config.dtype
        tensors = {name: t.to(dtype, copy=True) if t.is_floating_point() else t.clone()
                   for name, t in load_checkpoint(model_path).items()}
        setattr(self, _STAGED, (version, tensors))
        return {"num_tensors": len(tensors),
                "num_bytes": sum(t.numel() * t.element_size() for t in tensors.values())}

    def pdserve_commit_weights(self, version: str) -> None:
        """Copy the weights staged under ``version`` into the model, in place."""
        staged = getattr(self, _STAGED, None)
        if staged is None or staged[0] != version:
            held = "nothing" if staged is None else f"version {staged[0]!r}"
            raise StagingError(f"cannot commit version {version!r}: {held} is staged")
        setattr(self, _STAGED, None)
        runner = self.model_runner
        runner.reload_weights(weights_iterator=iter(staged[1].items()),
                              is_checkpoint_format=True)
        refresh_embedding_kernels(runner.get_model())

    def pdserve_discard_weights(self) -> bool:
        """Drop staged weights; whether there were any."""
        had = getattr(self, _STAGED, None) is not None
        setattr(self, _STAGED, None)
        return had
