"""``pdserve bench``'s flags (declared in ``flags_bench.py``: each picked here for its
subcommands), and one builder per frozen config the bench room takes (``run_config``,
``sweep_config``, ``compare_config``, ``gaps_config``). Only this layer touches argparse;
``pdserve.bench`` takes the configs.

``add_engine_flags`` + ``engine_settings``: the engine flags every bench that starts
systems shares (``--model``, ``--dtype``, ``--kv-cache-gib``, ``--max-model-len``)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys

from pdserve.bench.compare.config import (
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
from pdserve.bench.load.config import RunConfig, SweepConfig
from pdserve.bench.load.session import Session
from pdserve.cli.flags_bench import (
    ENGINE,
    GOODPUT_SHARE,
    PROXY,
    RUN_FLAGS,
    RUN_GROUPS,
    SWEEP_POINTS,
    SYSTEMS,
)
from pdserve.cli.parser import build_parser
from pdserve.core.dtype import DtypeChoice

# How bench runs pdserve itself (`pdserve up`, `pdserve bench run`, the proxy): as this
# command was run.
PDSERVE_COMMAND: tuple[str, ...] = (sys.executable, "-m", "pdserve.cli.main")

# Workload flags compare hands to every `pdserve bench run` as given (its contract's flags).
PASSTHROUGH: tuple[str, ...] = (
    "endpoint", "workload", "input-len", "output-len", "range-ratio", "mix", "mix-then",
    "mix-shift-at", "num-system-prompts", "system-prompt-len", "num-users", "num-turns",
    "turn-input-len", "dataset", "trace-block-tokens", "trace-time-scale", "trace-start",
    "num-requests", "duration-s", "num-warmup", "burstiness", "max-concurrency", "slo",
    "request-timeout-s",
)


# --- run, sweep ---------------------------------------------------------------------

def add_run_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench run``'s flags (``run_config`` reads them)."""
    for title, flags in RUN_GROUPS:
        group = p.add_argument_group(title)
        for flag in flags:
            if flag.name == "api-key":  # PDSERVE_API_KEY, else OpenAI clients' variable
                flag.add_to(group, default=os.environ.get("OPENAI_API_KEY"))
            else:
                flag.add_to(group)


def add_sweep_flags(p: argparse.ArgumentParser) -> None:
    """``pdserve bench sweep``'s flags: run's, and the points (``sweep_config``)."""
    add_run_flags(p)
    g = p.add_argument_group("sweep")
    given = any(flag.env in os.environ for flag in SWEEP_POINTS)
    points = g.add_mutually_exclusive_group(required=not given)
    for flag in SWEEP_POINTS:
        flag.add_to(points)
    GOODPUT_SHARE.add_to(g)


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
    for flag in ENGINE:
        flag.add_to(p)


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
    for name in ("request-rates", "pdserve", "with-vllm-disagg", "no-vllm", "no-vllm-stock",
                 "vllm-url", "output-dir", "startup-timeout-s", "run-timeout-s",
                 "stop-timeout-s", "seed"):
        SYSTEMS[name].add_to(p)
    RUN_FLAGS["ignore-eos"].add_to(p)
    SYSTEMS["cost-per-hour"].add_to(p)
    for name in PASSTHROUGH:  # unset unless given: each run's own default then
        RUN_FLAGS[name].add_to(p, default=None, help="passed to pdserve bench run")


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
    return ["--seed", str(args.seed), *(
        word for name in (*PASSTHROUGH, "ignore-eos")
        for word in RUN_FLAGS[name].argv(getattr(args, RUN_FLAGS[name].dest)))]


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
    SYSTEMS["pdserve"].add_to(p, help="a pdserve configuration (pdserve up flags); "
                              "repeatable (default: default='')")
    SYSTEMS["no-vllm"].add_to(p, help="skip the aggregated baseline")
    for name in ("num-requests", "stall-s", "seed"):
        SYSTEMS[name].add_to(p)
    SYSTEMS["output-dir"].add_to(p, help="where the report goes (absent or empty; default "
                                 "bench/results/gaps-<time>)")
    SYSTEMS["startup-timeout-s"].add_to(p)
    SYSTEMS["run-timeout-s"].add_to(p, default=900.0,
                                    help="deadline of one kind's requests against one system")
    SYSTEMS["stop-timeout-s"].add_to(p)


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
    for flag in PROXY:
        flag.add_to(p)
