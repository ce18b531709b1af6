"""``pdserve bench sweep``: one workload at several rates (or concurrencies), and the
highest one that meets the SLO.

A point meets the SLO when at least ``--goodput-share`` of the requests it sent (completed
or failed: a refused request does not meet it) met every SLO. ``max_rate_meeting_slo``
(``max_concurrency_meeting_slo``) is the highest such point."""

from __future__ import annotations

import argparse
import asyncio
import math
from dataclasses import replace
from typing import Any

from pdserve.bench.flags import add_sweep_flags, parse_list
from pdserve.bench.run import print_summary
from pdserve.bench.session import Session, schedule, write_json

SWEEP_SCHEMA = "pdserve.bench.sweep/v1"


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        "sweep", help="run at several rates or concurrencies; the highest meeting the SLO",
        description=__doc__.split("\n\n")[0])
    add_sweep_flags(p)
    return p


def meets_slo(result: dict[str, Any], share: float) -> bool:
    sent = result["completed"] + result["failed"]
    return sent > 0 and result["good"] >= share * sent


def main(args: argparse.Namespace) -> int:
    session = Session(args)
    if not session.slo.is_set:
        raise ValueError("sweep needs --slo (e.g. ttft=2s,tpot=100ms)")
    if not 0 < args.goodput_share <= 1:
        raise ValueError(f"--goodput-share must be in (0, 1], not {args.goodput_share}")
    base = schedule(args)
    if args.request_rates:
        key, points = "request_rate", parse_list(args.request_rates, float, "--request-rates")
        schedules = [replace(base, request_rate=r) for r in points]
    else:
        key = "max_concurrency"
        points = parse_list(args.max_concurrencies, int, "--max-concurrencies")
        schedules = [replace(base, max_concurrency=c, request_rate=math.inf) for c in points]
    runs = asyncio.run(session.run(schedules))
    met = [p for p, r in zip(points, runs, strict=True) if meets_slo(r, args.goodput_share)]
    name = "max_rate_meeting_slo" if key == "request_rate" else "max_concurrency_meeting_slo"
    result = {"schema": SWEEP_SCHEMA, "swept": key, "points": points,
              "goodput_share_target": args.goodput_share, "slo": session.slo.to_json(),
              "meets_slo": [meets_slo(r, args.goodput_share) for r in runs],
              name: max(met) if met else None, "runs": runs}
    if key == "request_rate":
        result["max_concurrency_meeting_slo"] = None
    else:
        result["max_rate_meeting_slo"] = None
    print_summary(runs, f"pdserve bench sweep over {key}")
    print(f"{name}: {result[name]} (goodput share >= {args.goodput_share:.0%})")
    if args.result_json:
        write_json(args.result_json, result)
        print(f"wrote {args.result_json}")
    return 0
