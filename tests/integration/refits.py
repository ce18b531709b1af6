"""What the refit tests share (``test_openai_weight_updates.py`` on the shared tcp cluster,
``test_weight_refit_processes.py`` on two router processes): the perturbed checkpoint
and its oracle, made once per session (conftest's ``checkpoints``), and a streamed
greedy completion that records what a refit may change in it.

The oracle is aggregated vLLM per checkpoint, greedy: the session's ``vllm serve`` for
the model's own weights (``references``), one engine run on the perturbed checkpoint
(``reference_engine.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from integration.oracles import reference_requests
from integration.pd_cases import LOCAL_PREFILL_MAX_TOKENS, MODEL
from pdserve_testing import kill_cluster, sse_events

from pdserve.bench.models.checkpoints import perturb_checkpoint
from pdserve.core import process

REFERENCE_TIMEOUT_S = 600
PROMPTS = (0, 1, 2)  # CASES' short completions (decode alone) and the long one (P -> D)
ORIGINAL, PERTURBED = "default", "v-perturbed"


@dataclass(frozen=True)
class Checkpoints:
    original: Path
    perturbed: Path
    requests: list[dict[str, Any]]  # PROMPTS' reference requests (prompt ids, max_tokens)
    refs: dict[str, list[list[int]]]  # version -> each request's greedy tokens


class PerturbedOracle:
    """The perturbed checkpoint and its engine run: ``start`` makes the checkpoint and
    launches the run (once), ``get`` waits for it."""

    def __init__(self, model_path: Path, tokenizer: Any, folder: Path) -> None:
        self._model_path, self._tokenizer, self._folder = model_path, tokenizer, folder
        self._proc: subprocess.Popen[bytes] | None = None
        self._perturbed: Path | None = None
        self._requests: list[dict[str, Any]] = []
        self._done: Checkpoints | None = None

    def start(self) -> None:
        if self._perturbed is not None:
            return
        folder = self._folder
        self._perturbed = perturb_checkpoint(self._model_path, folder / "perturbed", seed=1)
        self._requests = [reference_requests(self._tokenizer)[i] for i in PROMPTS]
        assert len(self._requests[0]["prompt_token_ids"]) < LOCAL_PREFILL_MAX_TOKENS < len(
            self._requests[2]["prompt_token_ids"])
        (folder / "in.json").write_text(json.dumps(self._requests))
        script = Path(__file__).with_name("reference_engine.py")
        self._proc = process.spawn(
            [sys.executable, str(script), str(self._perturbed), str(folder / "in.json"),
             str(folder / "out.json"), "float32"], log_path=folder / "engine.log")

    def get(self, references: list[list[int]]) -> Checkpoints:
        """Both versions' tokens (``references``: the model's own, in CASES' order)."""
        if self._done is None:
            self.start()
            assert self._proc is not None and self._perturbed is not None
            try:
                code = self._proc.wait(timeout=REFERENCE_TIMEOUT_S)
                assert code == 0, f"the perturbed reference failed: {self._folder}/engine.log"
            finally:
                self.close()
            refs = {ORIGINAL: [references[i] for i in PROMPTS],
                    PERTURBED: json.loads((self._folder / "out.json").read_text())}
            assert refs[ORIGINAL] != refs[PERTURBED], "the perturbation changed nothing"
            self._done = Checkpoints(self._model_path, self._perturbed, self._requests, refs)
        return self._done

    def close(self) -> None:
        if self._proc is not None:
            kill_cluster(self._proc)
            self._proc = None


def update(admin_url: str, path: Path, version: str, policy: str = "drain") -> httpx.Response:
    return httpx.post(f"{admin_url}/update_weights_from_disk", timeout=300,
                      json={"model_path": str(path), "weight_version": version,
                            "policy": policy})


def stream(base_url: str, request: dict[str, Any], index: int, out: list[dict[str, Any]]
           ) -> None:
    """A streamed greedy completion, appended to ``out``: its tokens, the fingerprints of
    its chunks, its ``x-weight-version`` header, finish, status and usage (with the
    ``weight_versions`` spans)."""
    got: dict[str, Any] = {"prompt": index, "tokens": [], "fingerprints": set(),
                           "finish": None, "usage": None}
    try:
        with httpx.stream("POST", base_url + "/completions", timeout=300, json={
                "model": MODEL, "prompt": request["prompt_token_ids"],
                "max_tokens": request["max_tokens"], "temperature": 0,
                "return_token_ids": True, "stream": True,
                "stream_options": {"include_usage": True}}) as resp:
            got["status"] = resp.status_code
            got["header"] = resp.headers.get("x-weight-version")
            if resp.status_code != 200:
                got["error"] = resp.read().decode(errors="replace")
            for event in sse_events(resp.iter_lines()):
                if "error" in event:
                    got["error"] = event["error"]
                    continue
                got["usage"] = event.get("usage") or got["usage"]
                if event["choices"]:
                    got["fingerprints"].add(event.get("system_fingerprint"))
                for choice in event["choices"]:
                    got["tokens"] += choice.get("token_ids") or []
                    got["finish"] = choice.get("finish_reason") or got["finish"]
    except httpx.HTTPError as exc:
        got["error"] = repr(exc)
    out.append(got)
