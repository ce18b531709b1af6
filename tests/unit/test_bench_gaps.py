"""``pdserve bench gaps`` without engines: each request's largest gap and stall count from
a constructed ``bench run`` result, the Markdown's ratios to the baseline, bad input,
and a whole run against ``pdserve up --simulated``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.compare import gaps
from pdserve.cli import bench_flags
from pdserve.cli.bench import build_parser

STALL_S = 1.0


def run_result(itls: list[list[float]], ttft_s: float = 0.1) -> dict[str, Any]:
    return {"requests": [{"ttft_s": ttft_s, "itls_s": g, "e2e_s": ttft_s + sum(g),
                          "output_tokens": len(g) + 1, "error": None} for g in itls]}


def test_each_request_reports_its_largest_gap_and_its_stalls() -> None:
    rows = gaps.request_rows(run_result([[0.1, 0.2, 0.1], [0.1, 5.05, 0.1, 5.04]]), STALL_S)
    assert [r["max_gap_s"] for r in rows] == [0.2, 5.05]
    assert [r["num_stalls"] for r in rows] == [0, 2]
    assert rows[1]["median_gap_s"] == pytest.approx((0.1 + 5.04) / 2)
    s = gaps.summary(rows)
    assert (s["num_ok"], s["num_stalled"], s["max_gap_s"]) == (2, 1, 5.05)
    assert s["ttft_max_s"] == 0.1


def test_a_failed_request_is_counted_not_measured() -> None:
    result = run_result([[0.1]])
    result["requests"].append({"ttft_s": None, "itls_s": [], "e2e_s": None,
                               "output_tokens": 0, "error": "timeout"})
    rows = gaps.request_rows(result, STALL_S)
    assert rows[1]["max_gap_s"] is None and gaps.summary(rows)["num_failed"] == 1


def report(base: list[list[float]], other: list[list[float]]) -> dict[str, Any]:
    def system(name: str, itls: list[list[float]]) -> dict[str, Any]:
        rows = gaps.request_rows(run_result(itls), STALL_S)
        return {"name": name, "kinds": {"short": {"requests": rows},
                                        "long": {"error": "bench run exited 2: x"}}}

    return {"settings": {"model": "m", "dtype": "float32", "dtype_reason": "as requested",
                         "stall_s": STALL_S},
            "machine": {"cpu_model": "cpu", "cores": [0, 1], "cpu_flags": {"avx2": True}},
            "baseline": "vllm", "systems": [system("vllm", base), system("pd", other)]}


def test_the_markdown_marks_stalls_and_gives_ratios_to_the_baseline() -> None:
    md = gaps.markdown(report([[0.1, 0.2]], [[0.1, 5.0]]))
    (row,) = [line for line in md.splitlines() if line.startswith("| pd | short |")]
    assert row.endswith("| 1 | 25.00x |")  # one stalled request; 5.0 / 0.2
    assert row.startswith("| pd | short | 1 | 0.100 | 0.100 | 5.000 |")  # TTFT p50, max
    assert "| 0 | 0.200 | 5.000 **stall** |" in md
    assert "| pd | long | failed: bench run exited 2: x |" in md


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["gaps", *argv])


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-requests", "0"], "--num-requests >= 1"),
    (["--stall-s", "0"], "--stall-s > 0"),
    (["--pdserve", "vllm="], "must differ"),
    (["--pdserve", "a=--nope"], "unrecognized arguments: --nope"),
])
def test_bad_input_fails_before_any_start(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        bench_flags.gaps_config(_parse(argv))


def test_num_prompts_is_num_requests_as_vllm_bench_serve_spells_it() -> None:
    assert _parse(["--num-prompts", "4"]).num_requests == 4
    assert _parse([]).num_requests == 6


def test_a_run_on_simulated_workers_writes_both_kinds(tmp_path: Path) -> None:
    out = tmp_path / "gaps"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "bench", "gaps", "--no-vllm", "--pdserve",
         "sim=--simulated", "--num-requests", "2", "--output-dir", str(out),
         "--startup-timeout-s", "120"], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "report.json").read_text())
    (system,) = result["systems"]
    assert system["name"] == "sim" and system["stop"]["left_behind"] == []
    assert set(system["kinds"]) == set(gaps.KINDS)
    for kind, res in system["kinds"].items():
        assert len(res["requests"]) == 2, (kind, res)
        for row in res["requests"]:
            assert row["error"] is None and row["output_tokens"] == gaps.KINDS[kind][1]
            assert 0 < row["max_gap_s"] < STALL_S
    assert "## long: each request's max gap (s)" in (out / "report.md").read_text()
