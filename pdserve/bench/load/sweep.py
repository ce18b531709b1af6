"""``pdserve bench sweep``: one workload at several rates (or concurrencies), and the
highest one that meets the SLO.

A point meets the SLO when at least ``--goodput-share`` of the requests it sent (completed
or failed: a refused request does not meet it) met every SLO. ``max_rate_meeting_slo``
(``max_concurrency_meeting_slo``) is the highest such point."""

from __future__ import annotations

import asyncio
import math
from dataclasses import replace
from typing import Any

from pdserve.bench.load.config import SweepConfig, parse_list
from pdserve.bench.load.run import print_summary
from pdserve.bench.load.session import Session, schedule, write_json

SWEEP_SCHEMA = "pdserve.bench.sweep/v1"


def meets_slo(result: dict[str, Any], share: float) -> bool:
    sent = result["completed"] + result["failed"]
    return sent > 0 and result["good"] >= share * sent


def main(cfg: SweepConfig) -> int:
    session = Session(cfg.run, cfg.recorded())
    if not session.slo.is_set:
        raise ValueError("sweep needs --slo (e.g. ttft=2s,tpot=100ms)")
    if not 0 < cfg.goodput_share <= 1:
        raise ValueError(f"--goodput-share must be in (0, 1], not {cfg.goodput_share}")
    base = schedule(cfg.run)
    if cfg.request_rates:
        key, points = "request_rate", parse_list(cfg.request_rates, float, "--request-rates")
        schedules = [replace(base, request_rate=r) for r in points]
    else:
        key = "max_concurrency"
        points = parse_list(cfg.max_concurrencies or "", int, "--max-concurrencies")
        schedules = [replace(base, max_concurrency=c, request_rate=math.inf) for c in points]
    runs = asyncio.run(session.run(schedules))
    met = [p for p, r in zip(points, runs, strict=True) if meets_slo(r, cfg.goodput_share)]
    name = "max_rate_meeting_slo" if key == "request_rate" else "max_concurrency_meeting_slo"
    result = {"schema": SWEEP_SCHEMA, "swept": key, "points": points,
              "goodput_share_target": cfg.goodput_share, "slo": session.slo.to_json(),
              "meets_slo": [meets_slo(r, cfg.goodput_share) for r in runs],
              name: max(met) if met else None, "runs": runs}
    if key == "request_rate":
        result["max_concurrency_meeting_slo"] = None
    else:
        result["max_rate_meeting_slo"] = None
    print_summary(runs, f"pdserve bench sweep over {key}")
    print(f"{name}: {result[name]} (goodput share >= {cfg.goodput_share:.0%})")
    if cfg.run.result_json:
        write_json(cfg.run.result_json, result)
        print(f"wrote {cfg.run.result_json}")
    return 0
