"""``stream.py``'s results as tables (markdown, to paste as they are) and as ratios to
the targets: router CPU per streamed token, added TTFT p50, scaling with router
processes, CPU per token against ``vllm-router``."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from pdserve.bench.micro.configs import RouterCostConfig

TARGET_CPU_US_PER_TOKEN = 30.0
TARGET_ADDED_TTFT_MS = 1.0
TARGET_SCALING = 0.8  # rate with N processes >= 0.8 N x the rate with one
TARGET_VS_VLLM = 1.0  # pdserve's CPU per token / vllm-router's
BASELINE = "vllm-router"


def _f(value: float, digits: int = 1) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def per_core_rate(paced: Mapping[str, float], tokens: int) -> float:
    """Tokens per second that one core of router CPU serves at ``tokens`` per request:
    what CPU per token and per request allow, whatever else shares the machine."""
    us_per_token = paced["router_cpu_us_per_token"] + (
        1e3 * paced["router_cpu_ms_per_request"] / tokens)
    return 1e6 / us_per_token if us_per_token > 0 else float("nan")


def paced_table(cfg: RouterCostConfig, results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = [f"paced: {cfg.streams} streams x {cfg.stream_tokens} tokens (and "
             f"{cfg.short_rounds} x {cfg.streams} x 2 tokens), engines at "
             f"{cfg.ms_per_token:g} ms/token; tok/s per router core: what the CPU per token "
             f"and per request allow at {cfg.stream_tokens} tokens per request", "",
             "| system | router CPU/token | CPU/request | tok/s per router core | added TTFT "
             "p50 | TTFT p50 / p99 (K at once) | ITL p50 / p99 | engines' own ITL p99 | max gap "
             "| failed | router / client / engines CPU |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        p = r["paced"]
        lines.append(
            f"| {name} | {_f(p['router_cpu_us_per_token'])} µs | "
            f"{_f(p['router_cpu_ms_per_request'], 2)} ms | "
            f"{_f(per_core_rate(p, cfg.stream_tokens), 0)} | {_f(p['added_ttft_p50_ms'], 2)} ms | "
            f"{_f(p['ttft_p50_ms'])} / {_f(p['ttft_p99_ms'])} ms | {_f(p['itl_p50_ms'])} / "
            f"{_f(p['itl_p99_ms'])} ms | {_f(p['direct_itl_p99_ms'])} ms | "
            f"{_f(p['max_gap_ms'], 0)} ms | {p['num_failed']:.0f} | "
            f"{p['router_cpu_pct']:.0f} / {p['client_cpu_pct']:.0f} / "
            f"{p['engines_cpu_pct']:.0f} % |")
    return lines


def scaling(results: Mapping[str, Mapping[str, Any]]) -> dict[int, float]:
    """N -> best rate with N processes / (N x best rate with one); NaN where either
    sweep had no passing step."""
    best = {int(name.rsplit("=", 1)[1]): (r["sweep"]["best"] or {}).get("tokens_per_s")
            for name, r in results.items() if "sweep" in r}
    one = best.get(1)
    return {n: rate / (n * one) if rate and one else float("nan") for n, rate in best.items()}


def sweep_table(cfg: RouterCostConfig, results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    limit = 1.1 * cfg.ms_per_token
    eff = scaling(results)
    lines = [f"sweep: highest token rate with ITL p99 <= 1.1 x the engines' own (>= {limit:g}"
             f" ms); {cfg.sweep_tokens}-token requests back to back, {cfg.sweep_window_s:g} s "
             "measured per step", "",
             "| router processes | tokens/s | at K streams | ITL p99 (engines' own) | router / "
             "client / engines CPU | rate / (N x rate at N=1) | stopped by |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        if "sweep" not in r:
            continue
        n, sw, b = int(name.rsplit("=", 1)[1]), r["sweep"], r["sweep"]["best"]
        if b is None:
            lines.append(f"| {n} | none passed | | | | | {sw['stopped_by']} |")
            continue
        lines.append(f"| {n} | {b['tokens_per_s']:.0f} | {b['streams']:.0f} | "
                     f"{_f(b['itl_p99_ms'])} ({_f(b['direct_itl_p99_ms'])}) ms | "
                     f"{b['router_cpu_pct']:.0f} / "
                     f"{b['client_cpu_pct']:.0f} / {b['engines_cpu_pct']:.0f} % | "
                     f"{_f(eff[n], 2)} | {sw['stopped_by']} |")
    return lines


def target_lines(results: Mapping[str, Mapping[str, Any]]) -> list[str]:
    lines = []
    first = next((r["paced"] for name, r in results.items() if name != BASELINE), None)
    if first is not None:
        cpu, ttft = first["router_cpu_us_per_token"], first["added_ttft_p50_ms"]
        lines += [f"router CPU per streamed token: {_f(cpu)} µs = "
                  f"{_f(cpu / TARGET_CPU_US_PER_TOKEN, 2)}x the {TARGET_CPU_US_PER_TOKEN:g} µs "
                  "target",
                  f"added TTFT p50: {_f(ttft, 2)} ms = {_f(ttft / TARGET_ADDED_TTFT_MS, 2)}x "
                  f"the {TARGET_ADDED_TTFT_MS:g} ms target"]
    for n, e in scaling(results).items():
        if n > 1:
            lines.append(f"scaling N={n}: {_f(e, 2)} N (target >= {TARGET_SCALING} N; "
                         f"{os.cpu_count()} cores, shared with the client and the engines)")
    if first is not None and BASELINE in results:
        base = results[BASELINE]["paced"]
        ratio = first["router_cpu_us_per_token"] / base["router_cpu_us_per_token"]
        per_request = first["router_cpu_ms_per_request"] / base["router_cpu_ms_per_request"]
        lines.append(f"CPU per token pdserve / vllm-router: {_f(ratio, 2)} (target <= "
                     f"{TARGET_VS_VLLM:g}); per request: {_f(per_request, 2)}")
    return lines


def report(cfg: RouterCostConfig, results: Mapping[str, Mapping[str, Any]]
           ) -> dict[str, Any]:
    """Print the tables and the targets; the numbers for ``--json``."""
    for line in [*paced_table(cfg, results), "", *sweep_table(cfg, results), "",
                 *target_lines(results)]:
        print(line)
    return {"systems": dict(results), "scaling": scaling(results),
            "targets": {"cpu_us_per_token": TARGET_CPU_US_PER_TOKEN,
                        "added_ttft_p50_ms": TARGET_ADDED_TTFT_MS,
                        "scaling": TARGET_SCALING, "vs_vllm_router": TARGET_VS_VLLM}}
