"""One aggregated vLLM engine, greedy, for the P/D equality oracle in a dtype the
session's ``vllm serve`` does not run (``oracles.EngineRuns``).

Run as ``python reference_engine.py MODEL IN.json OUT.json [DTYPE]`` (default
float32): IN holds
``[{"prompt_token_ids": [...], "max_tokens": N}, ...]``; OUT gets the output token
ids of each, and ``OUT.top.json`` each output position's top-5 candidates
(``{token id: logprob}``), so a bf16 comparison can tell a near-tie flip from an error.
A separate process, since vLLM spawns engine processes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pdserve.worker.engine_tmp import engine_tmp_dir

if TYPE_CHECKING:
    from vllm.config.model import ModelDType

TOP_K = 5


def main(model: str, in_path: str, out_path: str, dtype: str = "float32") -> None:
    # vLLM's ZMQ sockets and rendezvous file in a folder of this run's (as a worker's
    # engine has), removed at exit: not left in /tmp
    engine_tmp_dir(Path(out_path).resolve().parent)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(in_path) as f:
        requests = json.load(f)
    llm = LLM(model=model, dtype=cast("ModelDType", dtype), max_model_len=4096, enforce_eager=True,
              enable_prefix_caching=False)
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests],
        [SamplingParams(temperature=0, max_tokens=r["max_tokens"], logprobs=TOP_K)
         for r in requests],
    )
    with open(out_path, "w") as f:
        json.dump([list(o.outputs[0].token_ids) for o in outputs], f)
    with open(out_path + ".top.json", "w") as f:
        json.dump([[{str(t): lp.logprob for t, lp in pos.items()}
                    for pos in o.outputs[0].logprobs or []] for o in outputs], f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
