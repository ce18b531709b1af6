"""Real KV blocks for ``pdserve bench kv-compression``, and what each codec does to a
real engine's output.

A vLLM engine of the default model (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
prefix caching on) runs a few prompts of real text (the repository's docs), greedy, with
logprobs. Its KV cache, zeroed before, is read with ``collective_rpc``; a block counts
as written when at most 0.1 % of its values are exactly zero (a partly filled block's
empty slots are zeros). The prompts run again: their full blocks hit the prefix cache,
and this run on the raw KV is the reference. Then, for each codec, every written block
is encoded and decoded in place in the cache, the prompts run again (the lossy KV is
what the model attends to), and the outputs are compared with the reference's: greedy
token agreement and mean |Δ logprob| of the reference's tokens before the first
difference; then the blocks are restored. (The reference against the first run,
``PREFIX_HIT``, is the comparison's own noise: a prefix hit computes the prompt's last
block alone, which rounds differently in bfloat16.)

Run as ``python -m pdserve.bench.micro.kv_capture DTYPE PROMPTS BLOCKS MODES OUT``
(MODES comma-separated): OUT gets ``torch.save`` of ``{"dtype", "block_size",
"layers": [one (blocks, *chunk) tensor per layer], "shapes": [each layer's cache
shape], "quality": {mode: {...}}}``. A separate process per dtype: vLLM keeps state
in its process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, cast

import torch

from pdserve.core.model import resolve_model
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression import codec_for

_DOCS = ("architecture.md", "configuration.md", "security.md", "benchmarks.md",
         "testing.md")
_PROMPT_TOKENS = 2000
_OUTPUT_TOKENS = 32
_LOGPROBS = 5
# the quality entry comparing the prompts' first run (full prefill) with their rerun on
# the raw KV from the prefix cache: the noise floor of the comparison (0 in float32; in
# bfloat16 the two paths round differently)
PREFIX_HIT = "raw-prefix-hit-vs-full-prefill"


def main(dtype: str, num_prompts: int, num_blocks: int, modes: list[str], out: str) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams  # after the variables above: vLLM reads them
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(resolve_model(None).path), dtype=cast(Any, dtype),
              enforce_eager=True, max_model_len=_PROMPT_TOKENS + 2 * _OUTPUT_TOKENS,
              enable_prefix_caching=True)
    llm.collective_rpc(_zero)
    prompts = [TokensPrompt(prompt_token_ids=ids)
               for ids in _prompts(llm.get_tokenizer(), num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=_OUTPUT_TOKENS, logprobs=_LOGPROBS)
    full = llm.generate(prompts, params)
    (written,) = llm.collective_rpc(_written)
    (captured,) = llm.collective_rpc(_read, args=(written[:num_blocks],))
    (saved,) = llm.collective_rpc(_read, args=(written,))
    reference = llm.generate(prompts, params)  # the raw KV, from the prefix cache
    quality = {PREFIX_HIT: _compare(full, reference)}
    for mode in modes:
        llm.collective_rpc(_round_trip, args=(mode, written))
        quality[mode] = _compare(reference, llm.generate(prompts, params))
        llm.collective_rpc(_restore, args=(saved, written))
    torch.save(captured | {"dtype": dtype, "quality": quality}, out)


def _prompts(tokenizer: Any, count: int) -> list[list[int]]:
    root = Path(__file__).resolve().parents[3] / "docs"
    text = "\n".join((root / name).read_text() for name in _DOCS if (root / name).is_file())
    ids = tokenizer.encode(text)
    if len(ids) < _PROMPT_TOKENS:
        raise RuntimeError(f"only {len(ids)} tokens of docs to prompt with")
    step = max(1, (len(ids) - _PROMPT_TOKENS) // max(1, count - 1))
    return [ids[i * step:i * step + _PROMPT_TOKENS] for i in range(count)]


def _compare(baseline: list[Any], other: list[Any]) -> dict[str, float]:
    """Greedy agreement of ``other``'s outputs with ``baseline``'s: tokens equal at the
    same position, whole outputs equal, and mean |Δ logprob| of the baseline's token up
    to the first difference; and the prompt tokens that hit the prefix cache."""
    same = total = exact = cached = 0
    deltas: list[float] = []
    for base, run in zip(baseline, other, strict=True):
        a, b = base.outputs[0], run.outputs[0]
        same += sum(x == y for x, y in zip(a.token_ids, b.token_ids, strict=False))
        total += len(a.token_ids)
        exact += list(a.token_ids) == list(b.token_ids)
        cached += run.num_cached_tokens or 0
        for token, pa, pb in zip(a.token_ids, a.logprobs or [], b.logprobs or [],
                                 strict=False):
            if token not in pb:
                break
            deltas.append(abs(pa[token].logprob - pb[token].logprob))
            if max(pb, key=lambda t: pb[t].logprob) != token:
                break
    return {"token_agreement": same / max(total, 1), "exact_outputs": exact / len(baseline),
            "mean_abs_dlogprob": sum(deltas) / max(len(deltas), 1),
            "cached_tokens_per_prompt": cached / len(baseline)}


def _caches(worker: Any) -> list[Any]:
    return list(worker.model_runner.kv_caches)


def _block_dim(worker: Any) -> int:
    return 0 if _caches(worker)[0].dim() == 4 else 1  # CPU (blocks, ...) / CUDA (2, ...)


def _zero(worker: Any) -> None:
    for cache in _caches(worker):
        cache.zero_()


def _written(worker: Any) -> list[int]:
    caches, dim = _caches(worker), _block_dim(worker)
    found = [b for b in range(caches[0].shape[dim])
             if all(float((c.select(dim, b) == 0).float().mean()) <= 1e-3
                    for c in caches[:2])]
    if not found:
        raise RuntimeError("no full KV block was written")
    return found


def _read(worker: Any, blocks: list[int]) -> dict[str, Any]:
    caches, dim = _caches(worker), _block_dim(worker)
    index = torch.tensor(blocks)
    layers = [c.index_select(dim, index).movedim(dim, 0).contiguous().cpu() for c in caches]
    return {"block_size": int(worker.cache_config.block_size), "layers": layers,
            "shapes": [tuple(c.shape) for c in caches]}


def _round_trip(worker: Any, mode: str, blocks: list[int]) -> None:
    """Encode and decode each of ``blocks`` with codec ``mode``, in place."""
    caches, dim = _caches(worker), _block_dim(worker)
    layout = KVLayout.from_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)},
                                     caches[0].shape[dim], worker.cache_config.block_size)
    codec = codec_for(mode, layout)
    for b in blocks:
        chunks = [c.select(dim, b) for c in caches]
        codec.decode(codec.encode(chunks), chunks)


def _restore(worker: Any, saved: dict[str, Any], blocks: list[int]) -> None:
    caches, dim = _caches(worker), _block_dim(worker)
    for cache, layer in zip(caches, saved["layers"], strict=True):
        for i, b in enumerate(blocks):
            cache.select(dim, b).copy_(layer[i])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split(","),
         sys.argv[5])
