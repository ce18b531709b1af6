"""``pdserve bench gaps``: lone requests, one at a time on an idle system, short and
long, against one aggregated ``vllm serve`` and pdserve configurations on the same cores
and engine settings (``compare``'s systems); per request its TTFT, its largest gap
between two tokens, and its total. On an idle machine a gap of a second or more
(``--stall-s``) is a stall, not a timing: the check to run before trusting any figure.

Each system is started alone and gets ``pdserve bench run --max-concurrency 1`` once
per kind (random prompts of a fixed length, ``ignore_eos``), so a request never waits
for another. One report: ``report.json`` and ``report.md`` (per request, and per kind
with each system's worst gap next to the baseline's, and its worst TTFT: a stall before
the first token shows there, beside the baseline's for the same prompts).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.compare.launch import RunningSystem, StartupError
from pdserve.bench.compare.main import run_bench
from pdserve.bench.compare.report import machine_info, versions
from pdserve.bench.compare.systems import (
    EngineSettings,
    SystemSpec,
    pdserve_command,
    pdserve_up,
    vllm_aggregated,
)
from pdserve.core.dtype import DtypeChoice
from pdserve.core.ports import free_port

SCHEMA = "pdserve.bench.gaps/v1"
# kind -> (prompt tokens, output tokens): a chat turn, and a long document prompt.
KINDS: dict[str, tuple[int, int]] = {"short": (15, 64), "long": (1100, 16)}


@dataclass(frozen=True)
class GapsConfig:
    settings: EngineSettings
    dtype: DtypeChoice
    pdserve: tuple[tuple[str, str], ...]
    with_vllm: bool
    num_requests: int  # per kind
    stall_s: float
    seed: int
    output_dir: Path
    startup_timeout_s: float
    run_timeout_s: float
    stop_timeout_s: float
    # How to run pdserve itself (`pdserve up`, `pdserve bench run`).
    pdserve_command: tuple[str, ...] = field(default_factory=pdserve_command)


def check_requests(num_requests: int, stall_s: float) -> None:
    if num_requests < 1 or stall_s <= 0:
        raise ValueError("need --num-requests >= 1 and --stall-s > 0")


def main(cfg: GapsConfig) -> int:
    """Run ``cfg`` (checked when built: the CLI's ``gaps_config``), write the report."""
    _say(cfg.dtype.describe())
    report = run_gaps(cfg)
    cfg.output_dir.mkdir(parents=True, exist_ok=True)
    (cfg.output_dir / "report.json").write_text(json.dumps(report, indent=1) + "\n")
    (cfg.output_dir / "report.md").write_text(markdown(report))
    print(markdown(report))
    print(f"report: {cfg.output_dir}/report.md")
    return 0


def systems(cfg: GapsConfig) -> list[SystemSpec]:
    specs = [vllm_aggregated(cfg.settings, free_port())] if cfg.with_vllm else []
    return specs + [pdserve_up(cfg.settings, free_port(), n, f, cfg.pdserve_command)
                    for n, f in cfg.pdserve]


def run_gaps(cfg: GapsConfig) -> dict[str, Any]:
    results = [run_system(spec, cfg) for spec in systems(cfg)]
    return {"schema": SCHEMA, "machine": machine_info(), "versions": versions(),
            "settings": {"model": cfg.settings.served_name, "dtype": cfg.dtype.dtype,
                         "dtype_reason": cfg.dtype.reason, "cores": list(cfg.settings.cores),
                         "kinds": {k: {"prompt_tokens": p, "output_tokens": o}
                                   for k, (p, o) in KINDS.items()},
                         "num_requests": cfg.num_requests, "stall_s": cfg.stall_s,
                         "command": sys.argv},
            "baseline": "vllm" if cfg.with_vllm else None, "systems": results}


def run_system(spec: SystemSpec, cfg: GapsConfig) -> dict[str, Any]:
    result: dict[str, Any] = {"name": spec.name, "spec": spec.to_json(), "kinds": {}}
    _say(f"{spec.name}: starting (cores {spec.cores})")
    running = RunningSystem(spec, cfg.output_dir / "logs" / spec.name, cfg.stop_timeout_s)
    with running:
        try:
            result["startup_s"] = running.wait_ready(cfg.startup_timeout_s)
        except StartupError as exc:
            result["error"] = str(exc)
            _say(f"{spec.name}: failed to start: {exc}")
        else:
            for kind in KINDS:
                out = cfg.output_dir / "runs" / spec.name / f"{kind}.json"
                run, error = run_bench(lone_argv(spec, kind, cfg, out), out, cfg.run_timeout_s)
                result["kinds"][kind] = ({"error": error} if run is None
                                         else {"requests": request_rows(run, cfg.stall_s)})
                _say(f"{spec.name} {kind}: " + (error or _line(result["kinds"][kind])))
    result["stop"] = running.stop().to_json()
    return result


def lone_argv(spec: SystemSpec, kind: str, cfg: GapsConfig, out: Path) -> list[str]:
    prompt, output = KINDS[kind]
    return [*cfg.pdserve_command, "bench", "run", "--base-url", spec.base_url,
            "--model", cfg.settings.served_name, "--tokenizer", cfg.settings.model_path,
            "--endpoint", "completions", "--workload", "random", "--input-len", str(prompt),
            "--output-len", str(output), "--ignore-eos", "--max-concurrency", "1",
            "--num-requests", str(cfg.num_requests), "--num-warmup", "1",
            "--seed", str(cfg.seed), "--result-json", str(out), "--no-progress"]


def request_rows(run: dict[str, Any], stall_s: float) -> list[dict[str, Any]]:
    """Each request of a ``bench run`` result: TTFT, largest and median gap, total, and
    how many of its gaps are stalls (``None`` values for a failed request)."""
    rows = []
    for r in run["requests"]:
        gaps = r.get("itls_s") or []
        rows.append({"ttft_s": r.get("ttft_s"), "max_gap_s": max(gaps, default=None),
                     "median_gap_s": statistics.median(gaps) if gaps else None,
                     "total_s": r.get("e2e_s"), "output_tokens": r.get("output_tokens"),
                     "num_stalls": sum(g >= stall_s for g in gaps), "error": r.get("error")})
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rows if r["error"] is None and r["max_gap_s"] is not None]
    if not ok:
        return {"num_ok": 0, "num_failed": len(rows)}
    return {"num_ok": len(ok), "num_failed": len(rows) - len(ok),
            "max_gap_s": max(r["max_gap_s"] for r in ok),
            "median_max_gap_s": statistics.median(r["max_gap_s"] for r in ok),
            "ttft_p50_s": statistics.median(r["ttft_s"] for r in ok),
            "ttft_max_s": max(r["ttft_s"] for r in ok),
            "total_p50_s": statistics.median(r["total_s"] for r in ok),
            "num_stalled": sum(r["num_stalls"] > 0 for r in ok)}


def _line(kind_result: dict[str, Any]) -> str:
    s = summary(kind_result["requests"])
    if not s["num_ok"]:
        return "every request failed"
    return (f"max gap {s['max_gap_s']:.2f} s, TTFT p50 {s['ttft_p50_s']:.2f} s, "
            f"{s['num_stalled']}/{s['num_ok']} stalled")


def markdown(report: dict[str, Any]) -> str:
    st, m = report["settings"], report["machine"]
    flags = ", ".join(f"{'has' if v else 'lacks'} {k}" for k, v in m["cpu_flags"].items())
    lines = ["# pdserve bench gaps: lone requests, largest gap between two tokens", "",
             f"Machine: {m['cpu_model']}, cores {m['cores']}; {flags}. Model "
             f"`{st['model']}`, dtype {st['dtype']} ({st['dtype_reason']}). A gap >= "
             f"{st['stall_s']:g} s is a stall.", "",
             "| system | kind | requests | TTFT p50 s | TTFT max s | max gap s "
             "| median of max gaps s | total p50 s | stalled | max gap / baseline |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = next((s for s in report["systems"] if s["name"] == report["baseline"]), None)
    for system in report["systems"]:
        for kind, res in system["kinds"].items():
            if "error" in res:
                lines.append(f"| {system['name']} | {kind} | failed: {res['error']} |")
                continue
            s = summary(res["requests"])
            if not s["num_ok"]:
                lines.append(f"| {system['name']} | {kind} | 0 of {s['num_failed']} ok |")
                continue
            ratio = _ratio(s, base, kind)
            lines.append(f"| {system['name']} | {kind} | {s['num_ok']} | {s['ttft_p50_s']:.3f} "
                         f"| {s['ttft_max_s']:.3f} | {s['max_gap_s']:.3f} "
                         f"| {s['median_max_gap_s']:.3f} | {s['total_p50_s']:.2f} "
                         f"| {s['num_stalled']} | {ratio} |")
    for kind in KINDS:
        lines += ["", f"## {kind}: each request's max gap (s)", "",
                  "| # | " + " | ".join(s["name"] for s in report["systems"]) + " |",
                  "|---" * (len(report["systems"]) + 1) + "|"]
        columns = [s["kinds"].get(kind, {}).get("requests", []) for s in report["systems"]]
        for i in range(max((len(c) for c in columns), default=0)):
            cells = [_gap(c[i]) if i < len(c) else "" for c in columns]
            lines.append(f"| {i} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _ratio(s: dict[str, Any], base: dict[str, Any] | None, kind: str) -> str:
    rows = (base or {}).get("kinds", {}).get(kind, {}).get("requests")
    b = summary(rows) if rows else {}
    return f"{s['max_gap_s'] / b['max_gap_s']:.2f}x" if b.get("max_gap_s") else "-"


def _gap(row: dict[str, Any]) -> str:
    if row["error"] is not None or row["max_gap_s"] is None:
        return f"failed ({row['error']})"
    mark = " **stall**" if row["num_stalls"] else ""
    return f"{row['max_gap_s']:.3f}{mark}"


def _say(text: str) -> None:
    print(f"[gaps] {text}", file=sys.stderr, flush=True)
