"""``pdserve bench run``: one workload against one endpoint, one JSON result."""

from __future__ import annotations

import asyncio
from typing import Any

from rich.console import Console
from rich.table import Table

from pdserve.bench.load.config import RunConfig
from pdserve.bench.load.session import Session, schedule, write_json


def _ms(stats: dict[str, float | None], key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value * 1e3:.1f}"


def print_summary(results: list[dict[str, Any]], title: str) -> None:
    table = Table(title=title)
    for col in ("rate", "conc", "done", "fail", "skip", "req/s", "out tok/s", "goodput",
                "TTFT p50/p99 ms", "TPOT p50 ms", "ITL p50/p99 ms", "E2E p50 ms", "cached"):
        table.add_column(col, justify="right")
    for r in results:
        c = r["config"]
        table.add_row(str(c["request_rate"]), str(c["max_concurrency"] or "-"),
                      str(r["completed"]), str(r["failed"]), str(r["skipped"]),
                      f"{r['request_throughput']:.2f}", f"{r['output_throughput']:.1f}",
                      f"{r['goodput']:.2f} ({r['goodput_share']:.0%})",
                      f"{_ms(r['ttft_s'], 'p50')}/{_ms(r['ttft_s'], 'p99')}",
                      _ms(r["tpot_s"], "p50"),
                      f"{_ms(r['itl_s'], 'p50')}/{_ms(r['itl_s'], 'p99')}",
                      _ms(r["e2e_s"], "p50"), f"{r['cached_token_share']:.0%}")
    console = Console()
    if not console.is_terminal:  # a log or a pipe: keep every column readable
        console = Console(width=180)
    console.print(table)
    for r in results:
        if trace := r.get("trace"):
            console.print(_trace_line(trace, r["cached_token_share"]))
        for kind, detail in r["error_examples"].items():
            console.print(f"[red]{r['errors'][kind]} x {kind}[/]: {detail}", markup=True)


def _trace_line(trace: dict[str, Any], cached_share: float) -> str:
    engine = trace["infinite_cache_token_ratio_engine_block"]
    return (f"trace: {trace['num_requests']} requests from {trace['start']}, "
            f"{trace['block_tokens']} tokens a block (x{trace['length_factor']:g} lengths), "
            f"times x{trace['time_scale']:g} ({trace['replay_span_s']:.0f} s); cached "
            f"{cached_share:.1%} vs an infinite cache's {trace['infinite_cache_token_ratio']:.1%}"
            f" ({engine['16']:.1%} / {engine['128']:.1%} in engine blocks of 16 / 128)")


def main(cfg: RunConfig) -> int:
    session = Session(cfg)
    sched = schedule(cfg)
    (result,) = asyncio.run(session.run([sched]))
    print_summary([result], f"pdserve bench run: {cfg.workload} on {result['config']['model']}")
    if cfg.result_json:
        write_json(cfg.result_json, result)
        print(f"wrote {cfg.result_json}")
    return 0
