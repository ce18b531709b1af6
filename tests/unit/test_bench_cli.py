"""``pdserve bench run|sweep`` as users run it (a subprocess): bad input is one error
line, a non-zero exit and no result file; a seeded run against simulated workers
(``pdserve up --simulated``: router + sim workers, no vLLM) writes a JSON whose counts are
right and agree with the router's own counters; the same seed sends the same prompts at
the same times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdserve_testing import Server, launch_up, router_metric, stop_up

from pdserve.core.ports import free_port

STARTUP_TIMEOUT_S = 90  # the router imports transformers: ~20 s on two busy cores
RUN_TIMEOUT_S = 120
MODEL = "SmolLM2-135M-Instruct"


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve.cli.main", "bench", *argv],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))


def assert_one_error(proc: subprocess.CompletedProcess[str], result: Path, needle: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("pdserve bench: error: "), proc.stderr
    assert needle in lines[0]
    assert not result.exists() and not list(result.parent.glob(f".{result.name}*"))


@pytest.fixture(scope="module")
def sim() -> Iterator[Server]:
    server = launch_up(["--simulated", "--port", str(free_port()),
                        "--startup-timeout-s", str(STARTUP_TIMEOUT_S)],
                       dict(os.environ, PDSERVE_LOG_LEVEL="WARNING"), STARTUP_TIMEOUT_S)
    try:
        yield server
    finally:
        stop_up(server.proc)


def test_an_unreachable_url_is_one_error(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", f"http://127.0.0.1:{free_port()}", "--model", MODEL,
                 "--result-json", str(out), "--no-progress")
    assert_one_error(proc, out, "cannot reach")


@pytest.mark.parametrize(("argv", "needle"), [
    (["--slo", "ttft=2"], "bad --slo item 'ttft=2'"),
    (["--slo", "speed=2s"], "bad --slo item"),
    (["--workload", "sharegpt", "--dataset", "EMPTY"], "no usable ShareGPT entry"),
    (["--workload", "sharegpt", "--dataset", "BROKEN"], "not JSON"),
    (["--num-requests", "0"], "--num-requests must be >= 1"),
    (["--workload", "mooncake-trace", "--dataset", "EMPTY", "--endpoint", "completions"],
     ":1: expected a JSON object, got list"),
])
def test_bad_input_is_one_error_before_any_request(tmp_path: Path, argv: list[str],
                                                   needle: str) -> None:
    (tmp_path / "empty.json").write_text("[]")
    (tmp_path / "broken.json").write_text('[{"conversations": [')
    argv = [str(tmp_path / f"{a.lower()}.json") if a in ("EMPTY", "BROKEN") else a
            for a in argv]
    out = tmp_path / "r.json"
    # Port 9 (discard) is never an HTTP server: these must fail before any connection.
    proc = bench("run", "--base-url", "http://127.0.0.1:9", "--model", MODEL,
                 "--result-json", str(out), "--no-progress", *argv)
    assert_one_error(proc, out, needle)


def test_a_wrong_model_is_one_error(sim: Server, tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    proc = bench("run", "--base-url", sim.base_url, "--model", "no-such-model",
                 "--result-json", str(out), "--no-progress")
    assert_one_error(proc, out, f"serves: {MODEL}")


def _counters(server: Server) -> dict[str, float]:
    url = server.base_url.removesuffix("/v1")
    return {
        "ok": router_metric(url, "pdserve:http_requests_total",
                            'endpoint="/v1/chat/completions"', 'status_code="200"'),
        "prompt": router_metric(url, "pdserve:prompt_tokens_total"),
        "generation": router_metric(url, "pdserve:generation_tokens_total"),
    }


def _run(sim: Server, out: Path, *argv: str) -> dict[str, Any]:
    proc = bench("run", "--base-url", sim.base_url, "--model", MODEL, "--no-progress",
                 "--result-json", str(out), *argv)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.read_text())


def test_a_seeded_run_on_simulated_workers_writes_the_right_counts(sim: Server,
                                                                   tmp_path: Path) -> None:
    argv = ("--workload", "chat-mix", "--mix", "0.5:60:8,0.5:200:3", "--num-requests", "12",
            "--request-rate", "20", "--seed", "3", "--num-warmup", "1", "--slo", "ttft=5s")
    before = _counters(sim)
    result = _run(sim, tmp_path / "a.json", *argv)
    after = _counters(sim)
    assert result["schema"] == "pdserve.bench.run/v1"
    assert (result["num_requests"], result["completed"], result["failed"],
            result["skipped"], result["errors"]) == (12, 12, 0, 0, {})
    reqs = result["requests"]
    assert len(reqs) == 12
    assert {(r["prompt_tokens"], r["output_tokens"]) for r in reqs} <= {(60, 8), (200, 3)}
    assert result["input_tokens"] == sum(r["prompt_tokens"] for r in reqs)
    assert result["output_tokens"] == sum(r["output_tokens"] for r in reqs)
    # A chunk a token, except tokens that decode to no text yet (made-up ids: byte pieces).
    assert all(0 < len(r["itls_s"]) + 1 <= r["output_tokens"] for r in reqs)
    # The router saw the same: 12 measured requests and one warm-up.
    assert after["ok"] - before["ok"] == 13
    warm = after["prompt"] - before["prompt"] - result["input_tokens"]
    assert warm in (60, 200)
    assert after["generation"] - before["generation"] == result["output_tokens"] + (
        8 if warm == 60 else 3)
    assert result["config"]["seed"] == 3 and result["config"]["request_rate"] == 20.0
    assert result["goodput_share"] == 1.0 and result["ttft_s"]["p99"] > 0
    again = _run(sim, tmp_path / "b.json", *argv)
    assert [r["prompt_tokens"] for r in again["requests"]] == [r["prompt_tokens"] for r in reqs]
    starts = [r["start_s"] for r in reqs]
    assert [r["start_s"] for r in again["requests"]] == pytest.approx(starts, abs=0.05)
    assert starts[-1] == pytest.approx(12 / 20, abs=0.05)  # n arrivals span n / rate


TRACE = Path(__file__).parent.parent / "data" / "mooncake_conversation_sample.jsonl"


def test_a_trace_replay_sends_its_token_blocks_and_reports_its_scale(sim: Server,
                                                                     tmp_path: Path) -> None:
    url = sim.base_url.removesuffix("/v1")
    ok = ('endpoint="/v1/completions"', 'status_code="200"')
    before = (router_metric(url, "pdserve:http_requests_total", *ok),
              router_metric(url, "pdserve:prompt_tokens_total"))
    result = _run(sim, tmp_path / "r.json", "--workload", "mooncake-trace", "--dataset",
                  str(TRACE), "--endpoint", "completions", "--trace-block-tokens", "16",
                  "--request-rate", "40", "--trace-start", "8", "--num-requests", "16",
                  "--output-len", "4", "--num-warmup", "0")
    after = (router_metric(url, "pdserve:http_requests_total", *ok),
             router_metric(url, "pdserve:prompt_tokens_total"))
    raw = [json.loads(line) for line in TRACE.read_text().splitlines()][8:24]
    assert (result["num_requests"], result["completed"], result["failed"]) == (16, 16, 0)
    assert sorted(r["prompt_tokens"] for r in result["requests"]) == sorted(
        -(-r["input_length"] // 32) for r in raw)  # 16 of 512 tokens: a 32nd
    assert after[0] - before[0] == 16 and after[1] - before[1] == result["input_tokens"]
    trace = result["trace"]
    assert (trace["block_tokens"], trace["num_requests"]) == (16, 16)
    assert 0 < trace["infinite_cache_token_ratio"] < 1
    # --request-rate 40: the 16 requests' trace times scaled to span 16 / 40 s
    assert trace["replay_span_s"] == pytest.approx(0.4)
    assert max(r["start_s"] for r in result["requests"]) == pytest.approx(0.4, abs=0.15)


def test_a_trace_sweep_scales_the_trace_to_each_rate(sim: Server, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = bench("sweep", "--base-url", sim.base_url, "--model", MODEL, "--no-progress",
                 "--result-json", str(out), "--workload", "mooncake-trace", "--dataset",
                 str(TRACE), "--endpoint", "completions", "--trace-block-tokens", "16",
                 "--trace-start", "8", "--num-requests", "8", "--output-len", "2",
                 "--num-warmup", "0", "--request-rates", "20,40", "--slo", "e2e=60s")
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert [r["trace"]["replay_span_s"] for r in runs] == pytest.approx([8 / 20, 8 / 40])
    assert [r["completed"] for r in runs] == [8, 8]


def test_prompts_over_the_context_are_skipped_and_counted(sim: Server, tmp_path: Path) -> None:
    # The sim router's context is 4096: 4000 + 200 does not fit, so nothing is sent.
    result = _run(sim, tmp_path / "r.json", "--input-len", "4000", "--output-len", "200",
                  "--num-requests", "3", "--num-warmup", "0", "--endpoint", "completions")
    assert (result["num_requests"], result["skipped"], result["completed"]) == (3, 3, 0)
    assert result["requests"] == [] and result["config"]["max_model_len"] == 4096


def test_a_sweep_finds_the_highest_rate_meeting_the_slo(sim: Server, tmp_path: Path) -> None:
    out = tmp_path / "s.json"
    proc = bench("sweep", "--base-url", sim.base_url, "--model", MODEL, "--no-progress",
                 "--input-len", "64", "--output-len", "4", "--num-requests", "4",
                 "--request-rates", "2,inf", "--slo", "e2e=30s", "--result-json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["schema"] == "pdserve.bench.sweep/v1"
    assert [r["config"]["request_rate"] for r in result["runs"]] == [2.0, "inf"]
    assert result["meets_slo"] == [True, True]
    assert result["max_rate_meeting_slo"] == float("inf")
