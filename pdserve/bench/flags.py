"""``pdserve bench run`` flags (``sweep`` takes them too and adds its own)."""

from __future__ import annotations

import argparse
import os

from pdserve.bench.workloads import WORKLOADS

DEFAULT_MIX = "0.7:80:96,0.3:1200:16"


def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or inf: {text!r}") from None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", required=True,
                   help="the server, e.g. http://127.0.0.1:8000 (with or without /v1)")
    g.add_argument("--model", help="the served model name (default: the server's first)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    g.add_argument("--api-key", default=os.environ.get("PDSERVE_API_KEY")
                   or os.environ.get("OPENAI_API_KEY"),
                   help="bearer key (default: $PDSERVE_API_KEY, else $OPENAI_API_KEY)")
    g.add_argument("--tokenizer", help="tokenizer folder (default: --model if it is a local "
                   "folder, else pdserve's default model folder)")
    g.add_argument("--max-model-len", type=int,
                   help="context length when the server's /v1/models does not say")
    g.add_argument("--request-timeout-s", type=float, default=600.0,
                   help="deadline of each request")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="ask for exact output lengths (default: on for synthetic workloads)")
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="random")
    w.add_argument("--input-len", type=int, default=256, help="random: prompt tokens")
    w.add_argument("--output-len", type=int, help="output tokens (random, shared-prefix: "
                   "default 128; sharegpt: overrides the reference completion's length)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random, chat-mix: lengths uniform within +-ratio")
    w.add_argument("--mix", default=DEFAULT_MIX,
                   help="chat-mix: SHARE:INPUT:OUTPUT,... (default %(default)s)")
    w.add_argument("--mix-then", help="chat-mix: a second mix the load shifts to at "
                   "--mix-shift-at (a load that changes under the system)")
    w.add_argument("--mix-shift-at", type=int, help="chat-mix with --mix-then: the index "
                   "of the first request drawn from it (default: half of --num-requests)")
    w.add_argument("--num-system-prompts", type=int, default=2)
    w.add_argument("--system-prompt-len", type=int, default=512)
    w.add_argument("--num-users", type=int, default=4)
    w.add_argument("--num-turns", type=int, default=3)
    w.add_argument("--turn-input-len", type=int, default=64)
    w.add_argument("--dataset", help="sharegpt: a .json or .jsonl file")
    s = p.add_argument_group("traffic")
    s.add_argument("--num-requests", type=int, help="requests to draw (default 100 unless "
                   "--duration-s)")
    s.add_argument("--duration-s", type=float, help="send for this long instead")
    s.add_argument("--num-warmup", type=int, default=1, help="unmeasured requests first")
    s.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests/s (inf: all at once)")
    s.add_argument("--burstiness", type=_rate, default=1.0,
                   help="1: Poisson; <1 burstier, >1 more regular (gamma intervals)")
    s.add_argument("--max-concurrency", type=int, help="most requests in flight")
    s.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--slo", help='e.g. "ttft=2s,tpot=100ms,e2e=30s" (any subset)')
    o.add_argument("--result-json", help="write the result here (only after a full run)")
    o.add_argument("--no-progress", action="store_true")


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    add_run_flags(p)
    g = p.add_argument_group("sweep")
    points = g.add_mutually_exclusive_group(required=True)
    points.add_argument("--request-rates", help='comma-separated, e.g. "0.5,1,1.5"')
    points.add_argument("--max-concurrencies", help='comma-separated, e.g. "1,2,4"')
    g.add_argument("--goodput-share", type=float, default=0.9,
                   help="a point meets the SLO when this share of its requests does")


def parse_list(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad {flag} {text!r}: expected comma-separated numbers") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"bad {flag} {text!r}: expected numbers > 0")
    return values
