"""``pdserve bench run`` against a real ``pdserve up`` (the session's ``pd_server``: vLLM
engines, ``--disagg auto``): the JSON's request, token and error counts equal the deltas of
the router's own ``/metrics`` counters over the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pdserve_testing import Server, wait_until

pytestmark = pytest.mark.integration

# The router's counters this test reads, by role: one place to rename them.
METRICS = {
    "requests": "pdserve:http_requests_total",  # {endpoint, status_code}
    "failures": "pdserve:request_failures_total",  # {endpoint, reason}
    "prompt_tokens": "pdserve:prompt_tokens_total",
    "generation_tokens": "pdserve:generation_tokens_total",
}
ENDPOINT = 'endpoint="/v1/chat/completions"'
RUN_TIMEOUT_S = 300


def _counters(server: Server) -> dict[str, float]:
    return {
        "ok": server.metric(METRICS["requests"], ENDPOINT, 'status_code="200"'),
        "all": server.metric(METRICS["requests"], ENDPOINT),
        "failures": server.metric(METRICS["failures"], ENDPOINT),
        "prompt": server.metric(METRICS["prompt_tokens"]),
        "generation": server.metric(METRICS["generation_tokens"]),
    }


def test_bench_run_counts_match_the_routers_counters(pd_server: Server, model_path: Path,
                                                     tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    before = _counters(pd_server)
    # Short prompts stay on decode (--disagg auto), the 300-token ones go P -> D.
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "bench", "run", "--base-url", pd_server.base_url,
         "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(model_path),
         "--workload", "chat-mix", "--mix", "0.5:60:8,0.5:300:4", "--num-requests", "6",
         "--request-rate", "4", "--num-warmup", "0", "--seed", "1", "--slo", "ttft=60s",
         "--no-progress", "--result-json", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr

    def counted() -> dict[str, float] | None:
        """The router counts a request once its response has gone out (a stream's last
        chunk may reach the client first): the counters once all 6 are."""
        c = _counters(pd_server)
        return c if c["all"] - before["all"] >= 6 else None

    after = wait_until(counted, timeout_s=10)
    assert after is not None, "the router never counted the run's 6 requests"
    delta = {k: after[k] - before[k] for k in before}
    result = json.loads(out.read_text())
    assert (result["num_requests"], result["skipped"]) == (6, 0)
    assert result["completed"] + result["failed"] == delta["all"] == 6
    assert result["completed"] == delta["ok"] - delta["failures"]
    assert result["failed"] == sum(result["errors"].values())
    assert result["failed"] == delta["all"] - delta["ok"] + delta["failures"]
    assert result["input_tokens"] == delta["prompt"]
    assert result["output_tokens"] == delta["generation"]
    assert {(r["prompt_tokens"], r["output_tokens"]) for r in result["requests"]} <= {
        (60, 8), (300, 4)}  # exact lengths through the chat template, ignore_eos
    assert result["completed"] == 6 and result["ttft_s"]["p50"] > 0


def _trace_line(at_ms: int, hash_ids: list[int]) -> str:
    return json.dumps({"timestamp": at_ms, "input_length": len(hash_ids) * 512,
                       "output_length": 64, "hash_ids": hash_ids})


def test_a_trace_replays_shared_blocks_are_vllms_cached_tokens(pd_server: Server,
                                                                model_path: Path,
                                                                tmp_path: Path) -> None:
    """Token-id prompts reach vLLM as they are: a request whose leading hash_ids an
    earlier one sent is served those tokens from the prefix cache, in whole 128-token
    blocks (vLLM's on CPUs), exactly as the result's bound says."""
    trace = tmp_path / "trace.jsonl"
    fresh = [list(range(k, k + 12)) for k in (100, 200)]
    requests = [list(range(12)),                     # 384 tokens at 32 a block: cold
                [*range(8), *range(300, 304)],      # 8 shared blocks: 256 tokens, 2 blocks
                list(range(12)),                     # all shared: 383 of 384 -> 256
                fresh[0],                            # cold
                [*range(6), *fresh[1][:6]]]          # 6 shared: 192 tokens -> 128
    trace.write_text("\n".join(_trace_line(i * 100, ids) for i, ids in enumerate(requests)))
    out = tmp_path / "trace.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "bench", "run", "--base-url", pd_server.base_url,
         "--model", "SmolLM2-135M-Instruct", "--tokenizer", str(model_path),
         "--endpoint", "completions", "--workload", "mooncake-trace", "--dataset", str(trace),
         "--trace-block-tokens", "32", "--num-requests", "5", "--max-concurrency", "1",
         "--num-warmup", "0", "--seed", "11", "--no-progress", "--result-json", str(out)],
        capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert (result["completed"], result["failed"]) == (5, 0)
    reqs = sorted(result["requests"], key=lambda r: r["start_s"])
    assert [(r["prompt_tokens"], r["output_tokens"]) for r in reqs] == [(384, 4)] * 5
    assert [r["cached_tokens"] for r in reqs] == [0, 256, 256, 0, 128]
    bound = result["trace"]["infinite_cache_token_ratio_engine_block"]["128"]
    assert bound == pytest.approx(640 / 1920) == result["cached_token_share"]
