"""``pdserve bench compare`` on a tiny workload: the test session's aggregated ``vllm
serve`` (``vllm_openai``, float32, max-model-len 4096, 1 GiB KV: compare gets the same
settings) as the external baseline (``--vllm-url``: compare starts no vLLM of its own)
and ``pdserve up --simulated`` (compare runs a pdserve system by its flags alone,
whatever they are; real ``pdserve up`` clusters are started by four other modules), one
rate, 4 short requests. It writes report.json, report.md and valid PNGs, leaves no
process and no port of its own behind, and leaves the session's ``vllm serve`` serving."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.bench.compare.launch import port_free

pytestmark = pytest.mark.integration

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUM_REQUESTS = 4


def _run_watching_children(argv: list[str], timeout_s: float
                           ) -> tuple[int, str, dict[psutil.Process, str]]:
    """Run ``argv``; every process that was ever its descendant (looked for once a
    second), with its command line."""
    seen: dict[psutil.Process, str] = {}
    with subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                          env=dict(os.environ, HF_HUB_OFFLINE="1")) as proc:
        stderr: list[str] = []
        reader = threading.Thread(target=lambda: stderr.extend(proc.stderr or []), daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout_s
        root = psutil.Process(proc.pid)
        while proc.poll() is None and time.monotonic() < deadline:
            with contextlib.suppress(psutil.NoSuchProcess):
                for p in root.children(recursive=True):
                    if p not in seen:
                        with contextlib.suppress(psutil.Error):
                            seen[p] = " ".join(p.cmdline())
            time.sleep(1.0)
        if proc.poll() is None:
            proc.kill()
            pytest.fail(f"compare still running after {timeout_s:.0f} s")
        reader.join(timeout=10)
    return proc.returncode, "".join(stderr), seen


def test_compare_writes_the_report_and_leaves_nothing_behind(
        tmp_path: Path, vllm_openai: str,
        vllm_process: tuple[subprocess.Popen[bytes], str, Path]) -> None:
    out = tmp_path / "report"
    vllm_url = vllm_openai.removesuffix("/v1")
    argv = [sys.executable, "-m", "pdserve.cli.main", "bench", "compare",
            "--vllm-url", vllm_openai, "--dtype", "float32", "--max-model-len", "4096",
            "--kv-cache-gib", "1",  # the session's vllm serve's settings
            "--pdserve", "default=--simulated", "--request-rates", "2", "--no-vllm-stock",
            "--num-requests", str(NUM_REQUESTS),
            "--workload", "random", "--input-len", "64", "--output-len", "8",
            "--seed", "1", "--slo", "ttft=10s,tpot=1s", "--startup-timeout-s", "400",
            "--run-timeout-s", "300", "--output-dir", str(out)]
    code, stderr, children = _run_watching_children(argv, timeout_s=1200)
    assert code == 0, stderr[-3000:]
    commands = list(children.values())
    assert not any("vllm.entrypoints.openai.api_server" in c for c in commands), commands
    assert any(" up " in c for c in commands)
    assert any(" sim-worker " in c and "decode" in c for c in commands), commands
    left = [c for p, c in children.items() if _alive(p)]
    assert left == [], f"left behind: {left}"
    # the external baseline was neither stopped nor signalled: still serving
    assert vllm_process[0].poll() is None
    models = httpx.get(f"{vllm_openai}/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"]

    report = json.loads((out / "report.json").read_text())
    assert (report["schema"], report["baseline"]) == ("pdserve.bench.compare/v1",
                                                      "vllm-external")
    assert [s["name"] for s in report["systems"]] == ["vllm-external", "default"]
    external = report["systems"][0]
    assert (external["kind"], external["spec"]["url"], external["spec"]["procs"]) == (
        "vllm-external", vllm_url, [])
    assert external["stop"]["external"] and external["stop"]["port_free"] is None
    assert external["spec"]["card"]["max_model_len"] == 4096
    assert report["settings"]["vllm_url"] == vllm_url
    # SLOs derived from the baseline's unloaded run; every run's goodput under them.
    assert report["derived_slo"]["ttft_s"] > 0 and report["derived_slo"]["tpot_s"] > 0
    assert report["systems"][0]["unloaded"]["result"]["completed"] == 8
    assert report["settings"]["kv_cache_gib"] == 1 and report["settings"]["seed"] == 1
    assert report["versions"]["vllm"] and report["machine"]["cores"]
    for system in report["systems"]:
        assert system["error"] is None, system["error"]
        assert system["stop"]["left_behind"] == []
        (run,) = system["runs"]
        assert run["error"] is None, run["error"]
        result = run["result"]
        assert result["schema"] == "pdserve.bench.run/v1"
        assert (result["completed"], result["failed"]) == (NUM_REQUESTS, 0)
        assert result["config"]["seed"] == 1
        assert result["ttft_s"]["p50"] > 0 and result["output_tokens"] == NUM_REQUESTS * 8
        # Goodput under the SLOs derived from the baseline's unloaded run: this run's
        # requests within them, over the run's duration.
        slo = report["derived_slo"]
        within = [r for r in result["requests"]
                  if r["ttft_s"] <= slo["ttft_s"] and r["tpot_s"] <= slo["tpot_s"]]
        assert result["goodput_derived"] == pytest.approx(
            len(within) / NUM_REQUESTS * result["request_throughput"])
    default = report["systems"][1]
    assert default["stop"]["port_free"] and not default["stop"]["external"]
    assert port_free(default["spec"]["port"])

    md = (out / "report.md").read_text()
    assert f"`vllm-external` is external: the vLLM server already running at {vllm_url}" in md
    row = next(line for line in md.split("## 2 req/s")[1].splitlines()
               if line.startswith("| default |"))
    assert row.count("×") >= 10  # every metric has its ratio to vllm-tuned (goodput*: unless 0)
    for name in ("ttft_cdf", "itl_cdf", "latency_vs_rate", "throughput_vs_rate"):
        data = (out / f"{name}.png").read_bytes()
        assert data[:8] == PNG_SIGNATURE and len(data) > 10_000
    assert not any(p.name.startswith(".report-") for p in tmp_path.iterdir())


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
