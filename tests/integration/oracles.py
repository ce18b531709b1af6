"""The oracles P/D answers are checked against: aggregated vLLM's greedy output for each
of CASES, then KILL_CASE, with each position's top-5 logprobs. float32 from the
session's ``vllm serve`` (``served_run``); another dtype from one engine run of its own
(``EngineRuns``: ``reference_engine.py`` in a subprocess, started ahead of its use so
that it loads while other tests run)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
from integration.pd_cases import CASES, KILL_CASE, MODEL, TopLogprobs, prompt_ids
from integration.reference_engine import TOP_K
from pdserve_testing import kill_cluster

from pdserve.core import process

Run = tuple[list[list[int]], list[list[TopLogprobs]]]  # token ids, top logprobs, per request
RUN_TIMEOUT_S = 600


def reference_requests(tokenizer: Any) -> list[dict[str, Any]]:
    return [{"prompt_token_ids": prompt_ids(tokenizer, c), "max_tokens": c.max_tokens}
            for c in [*CASES, KILL_CASE]]


def served_run(base_url: str, requests: list[dict[str, Any]]) -> Run:
    """``requests`` sent at once (the server batches them, as one engine run does), each
    with a cache salt of its own: none reuses another's KV."""

    def one(i: int) -> tuple[list[int], list[TopLogprobs]]:
        r = requests[i]
        reply = httpx.post(f"{base_url}/completions", timeout=RUN_TIMEOUT_S, json={
            "model": MODEL, "prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"],
            "temperature": 0, "logprobs": TOP_K, "return_token_ids": True,
            "return_tokens_as_token_ids": True, "cache_salt": f"reference-{i}"})
        reply.raise_for_status()
        choice = reply.json()["choices"][0]
        return list(choice["token_ids"]), [
            {int(t.removeprefix("token_id:")): lp for t, lp in pos.items()}
            for pos in choice["logprobs"]["top_logprobs"]]

    with ThreadPoolExecutor(len(requests)) as pool:
        runs = list(pool.map(one, range(len(requests))))
    return [ids for ids, _ in runs], [tops for _, tops in runs]


class EngineRuns:
    """One engine run per dtype: ``start`` launches it (once), ``get`` waits for it and
    reads it, ``close`` kills the runs still going."""

    def __init__(self, model_path: Path, requests: list[dict[str, Any]],
                 folder: Callable[[str], Path]) -> None:
        self._model_path = model_path
        self.requests = requests
        self._folder = folder  # a fresh folder for a dtype's files
        self._running: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
        self._done: dict[str, Run] = {}

    def start(self, dtype: str) -> None:
        if dtype in self._running or dtype in self._done:
            return
        tmp = self._folder(dtype)
        (tmp / "in.json").write_text(json.dumps(self.requests))
        script = Path(__file__).with_name("reference_engine.py")
        proc = process.spawn([sys.executable, str(script), str(self._model_path),
                              str(tmp / "in.json"), str(tmp / "out.json"), dtype],
                             log_path=tmp / "engine.log")
        self._running[dtype] = (proc, tmp)

    def get(self, dtype: str) -> Run:
        if dtype not in self._done:
            self.start(dtype)
            proc, tmp = self._running.pop(dtype)
            code = proc.wait(timeout=RUN_TIMEOUT_S)
            assert code == 0, f"reference run ({dtype}) exited {code}: see {tmp / 'engine.log'}"
            tops = json.loads((tmp / "out.json.top.json").read_text())
            self._done[dtype] = (
                json.loads((tmp / "out.json").read_text()),
                [[{int(t): lp for t, lp in pos.items()} for pos in req] for req in tops])
        return self._done[dtype]

    def close(self) -> None:
        for proc, _ in self._running.values():
            kill_cluster(proc)
        self._running.clear()
