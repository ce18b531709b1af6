"""``pdserve bench compare`` on real engines, on a tiny workload: aggregated ``vllm
serve`` and ``pdserve up`` (default flags), one rate, 4 short requests. It writes
report.json, report.md and valid PNGs, and leaves no process and no port behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from pdserve.bench.launch import port_free

pytestmark = pytest.mark.integration

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_REQUESTS = 4


def _ours(before: set[int]) -> list[str]:
    """Processes started since ``before`` that are an engine, a pdserve or a proxy."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if p.info["pid"] in before or p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if any(k in cmd for k in ("vllm.entrypoints", "pdserve.cli", "disagg_proxy")):
            out.append(f"{p.info['pid']} {cmd[:120]}")
    return out


def test_compare_writes_the_report_and_leaves_nothing_behind(tmp_path: Path) -> None:
    before = {p.pid for p in psutil.process_iter()}
    out = tmp_path / "report"
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "compare",
            "--pdserve", "default=", "--request-rates", "2", "--num-requests", str(NUM_REQUESTS),
            "--workload", "random", "--input-len", "64", "--output-len", "8",
            "--max-model-len", "512", "--kv-cache-gib", "1", "--seed", "1",
            "--slo", "ttft=10s,tpot=1s", "--startup-timeout-s", "400",
            "--run-timeout-s", "300", "--output-dir", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=1200,
                          env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]

    report = json.loads((out / "report.json").read_text())
    assert report["schema"] == "pdserve.bench.compare/v1" and report["baseline"] == "vllm"
    assert [s["name"] for s in report["systems"]] == ["vllm", "default"]
    assert report["settings"]["kv_cache_gib"] == 1 and report["settings"]["seed"] == 1
    assert report["versions"]["vllm"] and report["machine"]["cores"]
    for system in report["systems"]:
        assert system["error"] is None, system["error"]
        assert system["stop"]["left_behind"] == [] and system["stop"]["port_free"]
        (run,) = system["runs"]
        assert run["error"] is None, run["error"]
        result = run["result"]
        assert result["schema"] == "pdserve.bench.run/v1"
        assert (result["completed"], result["failed"]) == (NUM_REQUESTS, 0)
        assert result["config"]["seed"] == 1
        assert result["ttft_s"]["p50"] > 0 and result["output_tokens"] == NUM_REQUESTS * 8
        assert port_free(system["spec"]["port"])

    md = (out / "report.md").read_text()
    row = next(line for line in md.split("## 2 req/s")[1].splitlines()
               if line.startswith("| default |"))
    assert row.count("×") == 10  # every metric has its ratio to vllm
    for name in ("ttft_cdf", "itl_cdf", "latency_vs_rate", "throughput_vs_rate"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    assert not any(p.name.startswith(".report-") for p in tmp_path.iterdir())
    assert _ours(before) == []
