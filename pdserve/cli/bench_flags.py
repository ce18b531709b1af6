"""``pdserve bench``'s flags, and one builder per frozen config the bench room takes
(``run_config``, ``sweep_config``, ``compare_config``, ``gaps_config``). Only this layer
touches argparse; ``pdserve.bench`` takes the configs.

``add_engine_flags`` + ``engine_settings``: the engine flags every bench that starts
systems shares (``--model``, ``--dtype``, ``--kv-cache-gib``, ``--max-model-len``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.compare.config import (
    DEFAULT_RATES,
    CompareConfig,
    check_timeouts,
    check_trace_rates,
    check_vllm_disagg,
    output_dir,
    parse_rates,
    pdserve_entries,
)
from pdserve.bench.compare.config import engine_settings as _engine_settings
from pdserve.bench.compare.cost import Price
from pdserve.bench.compare.external import check_external
from pdserve.bench.compare.gaps import GapsConfig, check_requests
from pdserve.bench.compare.systems import EngineSettings
from pdserve.bench.load.config import DEFAULT_MIX, RunConfig, SweepConfig
from pdserve.bench.load.session import Session
from pdserve.bench.workload.generators import WORKLOADS
from pdserve.cli.parser import build_parser
from pdserve.core.dtype import DTYPES, DtypeChoice

# How bench runs pdserve itself (`pdserve up`, `pdserve bench run`, the proxy): as this
# command was run.
PDSERVE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pdserve.cli.main")

# Workload flags compare hands to every `pdserve bench run` as given (its contract's flags).
PASSTHROUGH: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--endpoint", {"choices": ("completions", "chat")}),
    ("--workload", {"choices": WORKLOADS}),
    ("--input-len", {"type": int}), ("--output-len", {"type": int}),
    ("--range-ratio", {"type": float}), ("--mix", {}), ("--mix-then", {}),
    ("--mix-shift-at", {"type": int}),
    ("--num-system-prompts", {"type": int}), ("--system-prompt-len", {"type": int}),
    ("--num-users", {"type": int}), ("--num-turns", {"type": int}),
    ("--turn-input-len", {"type": int}), ("--dataset", {}),
    ("--trace-block-tokens", {"type": int}), ("--trace-time-scale", {"type": float}),
    ("--trace-start", {"type": int}),
    ("--num-requests", {"type": int}), ("--duration-s", {"type": float}),
    ("--num-warmup", {"type": int}), ("--burstiness", {"type": float}),
    ("--max-concurrency", {"type": int}), ("--slo", {}),
    ("--request-timeout-s", {"type": float}),
)
# `vllm bench serve`'s spelling of our flags, accepted as the same flag.
VLLM_SPELLINGS: dict[str, tuple[str, ...]] = {"--num-requests": ("--num-prompts",)}


# --- run, sweep ---------------------------------------------------------------------

def _rate(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or inf: {text!r}") from None


def add_run_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench run``'s flags (``run_config`` reads them)."""
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
    w.add_argument("--output-len", type=int, help="output tokens (random, shared-prefix, "
                   "no-reuse: default 128; sharegpt: overrides the reference completion's "
                   "length; mooncake-trace: caps the trace's scaled output length)")
    w.add_argument("--range-ratio", type=float, default=0.0,
                   help="random, chat-mix: lengths uniform within +-ratio")
    w.add_argument("--mix", default=DEFAULT_MIX,
                   help="chat-mix: SHARE:INPUT:OUTPUT,... (default %(default)s)")
    w.add_argument("--mix-then", help="chat-mix: a second mix the load shifts to at "
                   "--mix-shift-at (a load that changes under the system)")
    w.add_argument("--mix-shift-at", type=int, help="chat-mix with --mix-then: the index "
                   "of the first request drawn from it (default: half of --num-requests)")
    w.add_argument("--num-system-prompts", type=int, default=2,
                   help="shared-prefix, no-reuse: system prompts the users share")
    w.add_argument("--system-prompt-len", type=int, default=512,
                   help="shared-prefix, no-reuse: tokens of each system prompt")
    w.add_argument("--num-users", type=int, default=4,
                   help="shared-prefix, no-reuse: conversations, their turns interleaved")
    w.add_argument("--num-turns", type=int, default=3,
                   help="shared-prefix, no-reuse: turns of each conversation")
    w.add_argument("--turn-input-len", type=int, default=64,
                   help="shared-prefix, no-reuse: tokens of each user turn")
    w.add_argument("--dataset", help="sharegpt: a .json or .jsonl file; mooncake-trace: "
                   "a Mooncake trace (JSONL: timestamp, input_length, output_length, "
                   "hash_ids), replayed from --trace-start, --num-requests of it")
    w.add_argument("--trace-block-tokens", type=int, default=512,
                   help="mooncake-trace: tokens per hash_id block (the trace's are 512; "
                   "prompt and output lengths scale by the same factor)")
    w.add_argument("--trace-time-scale", type=float, default=1.0,
                   help="mooncake-trace: the trace's arrival times multiplied by this "
                   "(0.1: ten times the trace's rate; 0: all at once); or give "
                   "--request-rate R: the times scaled to a mean of R requests/s")
    w.add_argument("--trace-start", type=int, default=0,
                   help="mooncake-trace: the index of the first record replayed")
    s = p.add_argument_group("traffic")
    s.add_argument("--num-requests", *VLLM_SPELLINGS["--num-requests"], type=int,
                   help="requests to draw (default 100 unless --duration-s)")
    s.add_argument("--duration-s", type=float, help="send for this long instead")
    s.add_argument("--num-warmup", type=int, default=1, help="unmeasured requests first")
    s.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="requests/s (inf: all at once; mooncake-trace: the trace's times "
                   "scaled to this mean rate, inf: its own times)")
    s.add_argument("--burstiness", type=_rate, default=1.0,
                   help="1: Poisson; <1 burstier, >1 more regular (gamma intervals)")
    s.add_argument("--max-concurrency", type=int, help="most requests in flight")
    s.add_argument("--seed", type=int, default=0)
    o = p.add_argument_group("output")
    o.add_argument("--slo", help='e.g. "ttft=2s,tpot=100ms,e2e=30s" (any subset)')
    o.add_argument("--result-json", help="write the result here (only after a full run)")
    o.add_argument("--no-progress", action="store_true")


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench sweep``'s flags: run's, and the points (``sweep_config``)."""
    add_run_flags(p)
    g = p.add_argument_group("sweep")
    points = g.add_mutually_exclusive_group(required=True)
    points.add_argument("--request-rates", help='comma-separated, e.g. "0.5,1,1.5"')
    points.add_argument("--max-concurrencies", help='comma-separated, e.g. "1,2,4"')
    g.add_argument("--goodput-share", type=float, default=0.9,
                   help="a point meets the SLO when this share of its requests does")


_RUN_FIELDS = tuple(RunConfig.__dataclass_fields__)


def run_config(args: argparse.Namespace) -> RunConfig:
    """The ``RunConfig`` of ``add_run_flags``' flags."""
    return RunConfig(**{name: getattr(args, name) for name in _RUN_FIELDS})


def sweep_config(args: argparse.Namespace) -> SweepConfig:
    """The ``SweepConfig`` of ``add_sweep_flags``' flags."""
    return SweepConfig(run_config(args), args.request_rates, args.max_concurrencies,
                       args.goodput_share)


# --- engine flags: compare, gaps, bench scripts ------------------------------------------

def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``engine_settings`` reads."""
    p.add_argument("--model", default=None, help="local HF model folder (default: pdserve's "
                   "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="every engine's dtype; auto is resolved once as pdserve does "
                   "(bfloat16 on CPUs with native bf16, float32 on the others)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per engine (GiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV blocks of aggregated vLLM and of each prefill engine (overrides "
                   "--kv-cache-gib there): a cache small enough that a workload's working "
                   "set exceeds it. pdserve's decode workers keep --kv-cache-gib: give its "
                   "entries --disagg always so every prompt is computed on a capped engine")
    p.add_argument("--max-model-len", type=int, default=4096)


def engine_settings(args: argparse.Namespace) -> tuple[EngineSettings, DtypeChoice]:
    """What every system's engines share (``add_engine_flags``' flags, the dtype resolved
    once, this process's cores), and how the dtype was chosen."""
    if args.num_kv_blocks is not None and args.num_kv_blocks < 2:
        raise ValueError("--num-kv-blocks must be >= 2 (a pdserve worker's least)")
    return _engine_settings(args.model, args.dtype, args.kv_cache_gib, args.max_model_len,
                            args.num_kv_blocks)


# --- compare ----------------------------------------------------------------------------

def add_compare_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench compare``'s flags (``compare_config`` reads them)."""
    add_engine_flags(p)
    p.add_argument("--request-rates", default=DEFAULT_RATES,
                   help="comma-separated req/s ('inf': all at once); one run per rate")
    p.add_argument("--pdserve", action="append", metavar="NAME='FLAGS'",
                   help="a pdserve configuration: a name and `pdserve up` flags, e.g. "
                   "split='--cpu-layout split'; repeatable (default: default='')")
    p.add_argument("--with-vllm-disagg", action="store_true",
                   help="also run vLLM's own disaggregated serving (NixlConnector)")
    p.add_argument("--no-vllm", action="store_true",
                   help="skip aggregated vLLM, tuned (the baseline) and stock (no ratios then)")
    p.add_argument("--no-vllm-stock", action="store_true",
                   help="skip stock vllm serve (the tuned baseline still runs)")
    p.add_argument("--vllm-url", default=None, metavar="URL",
                   help="the baseline is the vLLM OpenAI server already running at URL "
                   "(http://HOST:PORT, with or without /v1), named vllm-external, in place "
                   "of the vllm-tuned compare would start: compare neither starts nor stops "
                   "it, and its engine settings are its operator's (compare cannot check "
                   "they match). It must answer /v1/models within --startup-timeout-s and "
                   "serve --model's name. Stock vllm still starts unless --no-vllm-stock")
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where the report goes (must not exist or be empty; default "
                   "bench/results/compare-<time>)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=1800.0,
                   help="deadline of one bench run (one system at one rate)")
    p.add_argument("--stop-timeout-s", type=float, default=60.0,
                   help="SIGTERM grace before SIGKILL when stopping a system")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--cost-per-hour", default=None, metavar="PRICE[/core|/node]",
                   help="price each system's runs: $ per hour of a core its engines ran on "
                   "(0.05 or 0.05/core) or of the node (2.4/node); the report gains $ per "
                   "million input, output and within-SLO tokens")
    for flag, kwargs in PASSTHROUGH:
        p.add_argument(flag, *VLLM_SPELLINGS.get(flag, ()), default=None,
                       help="passed to pdserve bench run", **kwargs)


def compare_config(args: argparse.Namespace) -> CompareConfig:
    """Every check that can fail before a system starts."""
    rates = parse_rates(args.request_rates)
    check_trace_rates(args.workload, args.trace_time_scale, rates)
    check_timeouts(args.startup_timeout_s, args.run_timeout_s, args.stop_timeout_s)
    if args.vllm_url is not None and args.no_vllm:
        raise ValueError("--vllm-url names the baseline and --no-vllm skips it: pick one")
    entries = pdserve_entries(args.pdserve, ("vllm", "vllm-tuned", "vllm-disagg",
                                             "vllm-external"), check_up_flags)
    check_workload(workload_args(args))
    if args.with_vllm_disagg:
        check_vllm_disagg()
    out = output_dir(args.output_dir, "compare")
    settings, dtype = engine_settings(args)
    cost = Price.parse(args.cost_per_hour) if args.cost_per_hour is not None else None
    external = None
    if args.vllm_url is not None:  # last: it may wait up to --startup-timeout-s
        external = check_external(args.vllm_url, settings.served_name,
                                  args.startup_timeout_s)
    return CompareConfig(
        settings, rates, entries, not args.no_vllm, args.with_vllm_disagg,
        tuple(workload_args(args)), args.seed, args.slo, out, args.startup_timeout_s,
        args.run_timeout_s, args.stop_timeout_s, dtype, not args.no_vllm_stock,
        cost, external, PDSERVE_COMMAND)


def workload_args(args: argparse.Namespace) -> list[str]:
    """Compare's workload flags as every ``pdserve bench run`` gets them."""
    argv = ["--seed", str(args.seed)]
    for flag, _ in PASSTHROUGH:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    if args.ignore_eos is not None:
        argv.append("--ignore-eos" if args.ignore_eos else "--no-ignore-eos")
    return argv


def check_workload(argv: list[str]) -> None:
    """The workload flags as ``pdserve bench run`` checks them (SLO, mix, dataset...),
    so a bad one fails before any system starts, not at its first run."""
    parser = argparse.ArgumentParser(prog="pdserve bench run")
    add_run_flags(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["--base-url", "http://127.0.0.1:1", *argv])
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "bad workload flags") from None
    Session(run_config(args))  # its checks that need neither a server nor a tokenizer


def check_up_flags(name: str, flags: str) -> None:
    """Parse ``flags`` with ``pdserve up``'s own parser: a bad flag fails before any start."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(["up", *shlex.split(flags)])
    except SystemExit as exc:
        lines = err.getvalue().strip().splitlines()
        why = lines[-1] if lines else "not accepted by pdserve up"
        raise ValueError(f"--pdserve {name}: {why}") from exc


# --- gaps -------------------------------------------------------------------------------

def add_gaps_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench gaps``' flags (``gaps_config`` reads them)."""
    add_engine_flags(p)
    p.add_argument("--pdserve", action="append", metavar="NAME='FLAGS'",
                   help="a pdserve configuration (pdserve up flags); repeatable "
                   "(default: default='')")
    p.add_argument("--no-vllm", action="store_true", help="skip the aggregated baseline")
    p.add_argument("--num-requests", *VLLM_SPELLINGS["--num-requests"], type=int, default=6,
                   help="lone requests per kind")
    p.add_argument("--stall-s", type=float, default=1.0,
                   help="a gap this long between two tokens counts as a stall")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", type=Path, default=None,
                   help="where the report goes (absent or empty; default "
                   "bench/results/gaps-<time>)")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--run-timeout-s", type=float, default=900.0,
                   help="deadline of one kind's requests against one system")
    p.add_argument("--stop-timeout-s", type=float, default=60.0)


def gaps_config(args: argparse.Namespace) -> GapsConfig:
    """Every check that can fail before a system starts."""
    check_requests(args.num_requests, args.stall_s)
    check_timeouts(args.startup_timeout_s, args.run_timeout_s, args.stop_timeout_s)
    entries = pdserve_entries(args.pdserve, ("vllm",), check_up_flags)
    out = output_dir(args.output_dir, "gaps")
    settings, dtype = engine_settings(args)
    return GapsConfig(settings, dtype, entries, not args.no_vllm, args.num_requests,
                      args.stall_s, args.seed, out, args.startup_timeout_s,
                      args.run_timeout_s, args.stop_timeout_s, PDSERVE_COMMAND)


# --- disagg-proxy (compare's vllm-disagg, where vllm-router is not installed) -----------

def add_disagg_proxy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--prefill", required=True, help="the prefill engine's base URL")
    p.add_argument("--decode", required=True, help="the decode engine's base URL")
