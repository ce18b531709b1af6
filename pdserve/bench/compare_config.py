"""``pdserve bench compare``'s flags and the config built from them: every check that
can fail (bad flags, a ``--pdserve`` entry ``pdserve up`` refuses, workload flags
``pdserve bench run`` refuses, a missing model, a non-empty output folder) runs here,
before any system starts."""

from __future__ import annotations

import argparse
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.systems import EngineSettings, check_up_flags, parse_pdserve_entry
from pdserve.core.dtype import DTYPES, DtypeChoice

DEFAULT_RATES = "0.5,1,1.5"
# Workload flags handed to every `pdserve bench run` as given (its contract's flags).
PASSTHROUGH: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--endpoint", {"choices": ("completions", "chat")}),
    ("--workload", {"choices": ("random", "chat-mix", "shared-prefix", "sharegpt")}),
    ("--input-len", {"type": int}), ("--output-len", {"type": int}),
    ("--range-ratio", {"type": float}), ("--mix", {}), ("--mix-then", {}),
    ("--mix-shift-at", {"type": int}),
    ("--num-system-prompts", {"type": int}), ("--system-prompt-len", {"type": int}),
    ("--num-users", {"type": int}), ("--num-turns", {"type": int}),
    ("--turn-input-len", {"type": int}), ("--dataset", {}),
    ("--num-requests", {"type": int}), ("--duration-s", {"type": float}),
    ("--num-warmup", {"type": int}), ("--burstiness", {"type": float}),
    ("--max-concurrency", {"type": int}), ("--slo", {}),
    ("--request-timeout-s", {"type": float}),
)


@dataclass(frozen=True)
class CompareConfig:
    settings: EngineSettings
    rates: tuple[float, ...]
    pdserve: tuple[tuple[str, str], ...]  # (name, pdserve up flags)
    with_vllm: bool
    with_vllm_disagg: bool
    workload_args: tuple[str, ...]  # for every bench run
    seed: int
    slo: str | None
    output_dir: Path
    startup_timeout_s: float
    run_timeout_s: float
    stop_timeout_s: float
    dtype: DtypeChoice  # how settings.dtype was chosen (printed, and in the report)
    with_vllm_stock: bool = True  # stock vllm serve beside the tuned baseline


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "compare", help="aggregated vLLM vs pdserve (and vLLM's own P/D) on the same cores, "
        "same workload and rates; one report",
        description="Aggregated vLLM, optionally vLLM's own P/D, and pdserve configurations "
        "one after another on the same cores, the same seeded workload and rates against "
        "each; one report (report.json, report.md, PNG plots).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
    for flag, kwargs in PASSTHROUGH:
        p.add_argument(flag, default=None, help="passed to pdserve bench run", **kwargs)
    return p


def parse_rates(text: str) -> tuple[float, ...]:
    rates = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates: {part!r} is not a number or 'inf'") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"--request-rates: {part!r} must be > 0")
        rates.append(rate)
    if len(set(rates)) != len(rates):
        raise ValueError("--request-rates: a rate is given twice")
    return tuple(rates)


def check_workload(argv: list[str]) -> None:
    """The workload flags as ``pdserve bench run`` checks them (SLO, mix, dataset...),
    so a bad one fails before any system starts, not at its first run."""
    import contextlib
    import io

    from pdserve.bench.flags import add_run_flags
    from pdserve.bench.session import Session

    parser = argparse.ArgumentParser(prog="pdserve bench run")
    add_run_flags(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["--base-url", "http://127.0.0.1:1", *argv])
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "bad workload flags") from None
    Session(args)  # its checks that need neither a server nor a tokenizer


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    """Every check that can fail before a system starts."""
    rates = parse_rates(args.request_rates)
    if min(args.startup_timeout_s, args.run_timeout_s, args.stop_timeout_s) <= 0:
        raise ValueError("--startup-timeout-s, --run-timeout-s and --stop-timeout-s must "
                         "be > 0")
    entries = pdserve_entries(args.pdserve, ("vllm", "vllm-tuned", "vllm-disagg"))
    check_workload(workload_args(args))
    if args.with_vllm_disagg:
        check_vllm_disagg()
    out = output_dir(args.output_dir, "compare")
    settings, dtype = engine_settings(args)
    return CompareConfig(
        settings, rates, entries, not args.no_vllm, args.with_vllm_disagg,
        tuple(workload_args(args)), args.seed, args.slo, out, args.startup_timeout_s,
        args.run_timeout_s, args.stop_timeout_s, dtype, not args.no_vllm_stock)


def pdserve_entries(given: list[str] | None, reserved: tuple[str, ...]
                    ) -> tuple[tuple[str, str], ...]:
    """``--pdserve NAME=FLAGS`` entries (default: one named ``default`` with no flags),
    each checked by ``pdserve up``'s own parser; names unique and not ``reserved``."""
    entries = [parse_pdserve_entry(e) for e in (given or ["default="])]
    names = [n for n, _ in entries] + list(reserved)
    if len(set(names)) != len(names):
        raise ValueError("--pdserve names must differ from each other and from "
                         + ", ".join(f"'{n}'" for n in reserved))
    for name, flags in entries:
        check_up_flags(name, flags)
    return tuple(entries)


def output_dir(given: Path | None, kind: str) -> Path:
    """``given``, or ``bench/results/<kind>-<time>``; refused unless absent or empty."""
    out = given or Path("bench/results") / time.strftime(f"{kind}-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {out}: exists and is not an empty folder")
    return out


def engine_settings(args: argparse.Namespace) -> tuple[EngineSettings, DtypeChoice]:
    """What every system's engines share (``--model``, ``--dtype`` resolved once,
    ``--kv-cache-gib``, ``--max-model-len``, this process's cores), and how the dtype
    was chosen."""
    from pdserve.core.dtype import resolve_dtype
    from pdserve.core.model import resolve_model

    model = resolve_model(args.model)
    dtype = resolve_dtype(args.dtype, model_path=model.path)
    settings = EngineSettings(str(model.path), model.served_name, dtype.dtype,
                              args.kv_cache_gib, args.max_model_len,
                              tuple(sorted(_affinity())))
    return settings, dtype


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The flags ``engine_settings`` reads."""
    p.add_argument("--model", default=None, help="local HF model folder (default: pdserve's "
                   "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="every engine's dtype; auto is resolved once as pdserve does "
                   "(bfloat16 on CPUs with native bf16, float32 on the others)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per engine (GiB)")
    p.add_argument("--max-model-len", type=int, default=4096)


def _affinity() -> set[int]:
    return os.sched_getaffinity(0)


def workload_args(args: argparse.Namespace) -> list[str]:
    argv = ["--seed", str(args.seed)]
    for flag, _ in PASSTHROUGH:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            argv += [flag, str(value)]
    if args.ignore_eos is not None:
        argv.append("--ignore-eos" if args.ignore_eos else "--no-ignore-eos")
    return argv


def check_vllm_disagg() -> None:
    """vLLM's NixlConnector imports ``nixl``; on CPU the ``nixl-cu12`` wheel serves
    (pdserve's vLLM plugin maps ``nixl`` onto it when the meta package is missing)."""
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
        raise ValueError("--with-vllm-disagg needs NIXL for vLLM's NixlConnector: "
                         "pip install nixl-cu12")
    if len(_affinity()) < 2:
        raise ValueError("--with-vllm-disagg needs 2+ cores (prefill and decode engines on "
                         "separate cores)")
