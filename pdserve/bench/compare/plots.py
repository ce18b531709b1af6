"""The compare report written out: ``report.json``, ``report.md`` and its plots
(matplotlib, Agg: no display needed).

- ``ttft_cdf.png``, ``itl_cdf.png``: per rate, each system's CDF over its completed
  requests' TTFTs / every inter-token gap.
- ``latency_vs_rate.png``: TTFT, TPOT, ITL and E2E p50 (solid) and p99 (dashed).
- ``throughput_vs_rate.png``: request throughput and goodput, output tokens/s.
- ``cost_vs_rate.png`` (with ``--cost-per-hour``): $ per million input, output and
  within-SLO tokens.
- ``timeline-<system>-<rate>.png``: for a pdserve run whose workers changed role (a
  planner) or whose load shifted (``--mix-then``): over the run, the roles its workers
  served, each request's TTFT at its start, and the ITL p99 of each 10 s window. The
  roles' clock starts when the bench run is launched, its requests' after its one
  warm-up request: they may differ by that request's time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend is chosen)
import numpy as np  # noqa: E402

from pdserve.bench.compare.report import (  # noqa: E402
    CompareReport,
    SystemResult,
    metric,
    rate_label,
    render_markdown,
)

if TYPE_CHECKING:
    from matplotlib.axes import Axes


def write_report(report: CompareReport, out_dir: Path) -> list[Path]:
    """report.json, report.md and the plots into ``out_dir``; returns the files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report.to_json(), indent=1,
                                                    allow_nan=True))
    (out_dir / "report.md").write_text(render_markdown(report))
    return [out_dir / "report.json", out_dir / "report.md", *write_plots(report, out_dir)]


def write_plots(report: CompareReport, out_dir: Path) -> list[Path]:
    paths = [_cdf(report, "ttft", out_dir / "ttft_cdf.png"),
             _cdf(report, "itl", out_dir / "itl_cdf.png"),
             _vs_rate(report, out_dir / "latency_vs_rate.png",
                      [("TTFT (s)", "ttft_s", 1.0), ("TPOT (ms)", "tpot_s", 1e3),
                       ("ITL (ms)", "itl_s", 1e3), ("E2E (s)", "e2e_s", 1.0)]),
             _throughput(report, out_dir / "throughput_vs_rate.png")]
    if report.settings.get("cost_per_hour"):
        paths.append(_cost(report, out_dir / "cost_vs_rate.png"))
    shifting = "--mix-then" in str(report.settings.get("workload_args", ""))
    for system in _measured(report):
        for run in system.runs:
            roles = (run.result or {}).get("roles_timeline") or []
            if roles and (shifting or len({(p, d) for _, p, d in roles}) > 1):
                name = f"timeline-{system.name}-{rate_label(run.rate)}.png"
                paths.append(_timeline(system.name, run.rate, run.result or {},
                                       out_dir / name))
    return paths


WINDOW_S = 10.0


def _timeline(name: str, rate: float, result: dict[str, Any], path: Path) -> Path:
    fig, (roles_ax, ttft_ax, itl_ax) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    t, prefill, decode = (list(col) for col in zip(*result["roles_timeline"], strict=True))
    roles_ax.step(t, prefill, where="post", label="prefill")
    roles_ax.step(t, decode, where="post", label="decode")
    roles_ax.set_ylabel("workers")
    roles_ax.set_title(f"{name} at {rate_label(rate)} req/s: roles, TTFT, ITL over the run")
    _legend(roles_ax)
    done = [r for r in result.get("requests", []) if not r.get("error")]
    ttft_ax.scatter([r["start_s"] for r in done if r.get("ttft_s") is not None],
                    [r["ttft_s"] for r in done if r.get("ttft_s") is not None], s=8)
    ttft_ax.set_ylabel("TTFT (s)")
    gaps: list[tuple[float, float]] = []  # (when, gap)
    for r in done:
        at = r["start_s"] + (r.get("ttft_s") or 0.0)
        for gap in r.get("itls_s") or []:
            at += gap
            gaps.append((at, gap))
    if gaps:
        end = max(a for a, _ in gaps)
        edges = np.arange(0.0, end + WINDOW_S, WINDOW_S)
        p99 = [float(np.percentile(w, 99)) * 1e3 if (w := [g for a, g in gaps
                                                           if lo <= a < lo + WINDOW_S])
               else np.nan for lo in edges[:-1]]
        itl_ax.step(edges[:-1], p99, where="post")
    itl_ax.set_ylabel(f"ITL p99 (ms, {WINDOW_S:.0f} s windows)")
    itl_ax.set_xlabel("seconds into the run")
    return _save(fig, path)


def _samples(result: dict[str, Any], kind: str) -> list[float]:
    done = [r for r in result.get("requests", []) if not r.get("error")]
    if kind == "ttft":
        return [r["ttft_s"] for r in done if r.get("ttft_s") is not None]
    return [x for r in done for x in (r.get("itls_s") or [])]


def _cdf(report: CompareReport, kind: str, path: Path) -> Path:
    n = max(1, len(report.rates))
    fig, axes = plt.subplots(1, n, figsize=(5 * n, 4), squeeze=False)
    for ax, rate in zip(axes[0], report.rates, strict=False):
        for system in report.systems:
            run = system.run_at(rate)
            values = np.sort(_samples(run.result, kind) if run and run.result else [])
            if len(values):
                ax.step(values * (1e3 if kind == "itl" else 1.0),
                        np.arange(1, len(values) + 1) / len(values), where="post",
                        label=system.name)
        ax.set_title(f"{kind.upper()} CDF at {rate_label(rate)} req/s")
        ax.set_xlabel("ITL (ms)" if kind == "itl" else "TTFT (s)")
        ax.set_ylabel("share of " + ("gaps" if kind == "itl" else "requests"))
        ax.grid(alpha=0.3)
        _legend(ax)
    return _save(fig, path)


def _vs_rate(report: CompareReport, path: Path,
             panels: list[tuple[str, str, float]]) -> Path:
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    x = np.arange(len(report.rates))
    for ax, (title, key, scale) in zip(axes[0], panels, strict=True):
        for i, system in enumerate(_measured(report)):
            color = f"C{i}"
            for q, style in (("p50", "-"), ("p99", "--")):
                ax.plot(x, _series(report, system.name, (key, q), scale), style, marker="o",
                        color=color, label=f"{system.name} {q}")
        _rate_axis(ax, report, title)
    return _save(fig, path)


def _throughput(report: CompareReport, path: Path) -> Path:
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), squeeze=False)
    x = np.arange(len(report.rates))
    for i, system in enumerate(_measured(report)):
        color = f"C{i}"
        axes[0][0].plot(x, _series(report, system.name, ("request_throughput",)), "-",
                        marker="o", color=color, label=f"{system.name} completed")
        axes[0][0].plot(x, _series(report, system.name, ("goodput",)), "--", marker="s",
                        color=color, label=f"{system.name} goodput")
        axes[0][1].plot(x, _series(report, system.name, ("output_throughput",)), "-",
                        marker="o", color=color, label=system.name)
    _rate_axis(axes[0][0], report, "requests/s (completed, goodput)")
    _rate_axis(axes[0][1], report, "output tokens/s")
    return _save(fig, path)


COST_PANELS = (("$ / M input tokens", "usd_per_m_input"),
               ("$ / M output tokens", "usd_per_m_output"),
               ("$ / M tokens in SLO", "usd_per_m_tokens_in_slo"))


def _cost(report: CompareReport, path: Path) -> Path:
    fig, axes = plt.subplots(1, len(COST_PANELS), figsize=(13.5, 4), squeeze=False)
    x = np.arange(len(report.rates))
    for ax, (title, key) in zip(axes[0], COST_PANELS, strict=True):
        for i, system in enumerate(_measured(report)):
            ax.plot(x, _series(report, system.name, ("cost", key)), "-", marker="o",
                    color=f"C{i}", label=system.name)
        _rate_axis(ax, report, title)
    return _save(fig, path)


def _measured(report: CompareReport) -> list[SystemResult]:
    """The systems with at least one run result (a failed one draws no empty line)."""
    return [s for s in report.systems if any(r.result for r in s.runs)]


def _series(report: CompareReport, name: str, path: tuple[str, ...],
            scale: float = 1.0) -> list[float]:
    system = next(s for s in report.systems if s.name == name)
    out = []
    for rate in report.rates:
        run = system.run_at(rate)
        value = metric(run.result, path) if run and run.result else None
        out.append(float("nan") if value is None else value * scale)
    return out


def _rate_axis(ax: Axes, report: CompareReport, title: str) -> None:
    ax.set_xticks(np.arange(len(report.rates)), [rate_label(r) for r in report.rates])
    ax.set_xlabel("offered rate (req/s)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    _legend(ax)


def _legend(ax: Axes) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
