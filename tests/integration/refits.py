"""What the refit tests share (``test_openai_weight_updates.py`` on the shared tcp cluster,
``test_weight_refit_processes.py`` on two router processes): the perturbed checkpoint
and its oracle, made once per session (conftest's ``checkpoints``), and a streamed
greedy completion that records what a refit may change in it.

The oracle is aggregated vLLM per checkpoint, greedy: the session's ``vllm serve`` for
the model's own weights (``references``), one engine run on the perturbed checkpoint
(``reference_engine.py``)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from integration.oracles import reference_requests
from integration.pd_cases import LOCAL_PREFILL_MAX_TOKENS, MODEL
from pdserve_testing import kill_cluster

from pdserve.bench.checkpoints import perturb_checkpoint
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


def make_checkpoints(model_path: Path, tokenizer: Any, references: list[list[int]],
                     folder: Path) -> Checkpoints:
    """The perturbed copy of ``model_path`` in ``folder`` and both versions' tokens."""
    perturbed = perturb_checkpoint(model_path, folder / "perturbed", seed=1)
    requests = [reference_requests(tokenizer)[i] for i in PROMPTS]
    assert len(requests[0]["prompt_token_ids"]) < LOCAL_PREFILL_MAX_TOKENS < len(
        requests[2]["prompt_token_ids"])
    (folder / "in.json").write_text(json.dumps(requests))
    script = Path(__file__).with_name("reference_engine.py")
    proc = process.spawn([sys.executable, str(script), str(perturbed), str(folder / "in.json"),
                          str(folder / "out.json"), "float32"], log_path=folder / "engine.log")
    try:
        assert proc.wait(timeout=REFERENCE_TIMEOUT_S) == 0, "the perturbed reference failed"
    finally:
        kill_cluster(proc)
    refs = {ORIGINAL: [references[i] for i in PROMPTS],
            PERTURBED: json.loads((folder / "out.json").read_text())}
    assert refs[ORIGINAL] != refs[PERTURBED], "the perturbation changed nothing"
    return Checkpoints(model_path, perturbed, requests, refs)


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
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
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
