"""One aggregated vLLM engine with LoRA, greedy, float32: the oracle of
``test_lora_pd.py``. Run as ``python lora_reference.py MODEL IN.json OUT.json``: IN holds
``[{"prompt_token_ids": [...], "max_tokens": N, "lora_name": NAME|null,
"lora_path": PATH|null}, ...]``; OUT gets each request's output token ids. A separate
process, since vLLM spawns engine processes."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from pdserve.worker.engine_tmp import engine_tmp_dir


def main(model: str, in_path: str, out_path: str) -> None:
    # vLLM's ZMQ sockets and rendezvous file in a folder of this run's (as a worker's
    # engine has), removed at exit: not left in /tmp
    engine_tmp_dir(Path(out_path).resolve().parent)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    with open(in_path) as f:
        requests = json.load(f)
    names = sorted({r["lora_name"] for r in requests if r["lora_name"]})
    ids = {name: i + 1 for i, name in enumerate(names)}
    llm = LLM(model=model, dtype="float32", max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False, enable_lora=True, max_loras=2, max_lora_rank=8)
    outputs = [llm.generate(
        [TokensPrompt(prompt_token_ids=r["prompt_token_ids"])],
        SamplingParams(temperature=0, max_tokens=r["max_tokens"]),
        lora_request=LoRARequest(r["lora_name"], ids[r["lora_name"]], r["lora_path"])
        if r["lora_name"] else None)[0] for r in requests]
    with open(out_path, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
