"""``pdserve bench compare``: aggregated vLLM, optionally vLLM's own P/D, and pdserve
configurations, one after another on the same machine and cores, each driven by the
same seeded workload at the same rates (``pdserve bench run``); one report.

Each system is started alone (``launch.RunningSystem``), is ready once ``/v1/models``
answers and one warm request completes, gets one ``bench run`` per rate, and is
stopped (SIGTERM to its process groups, a deadline, SIGKILL) and checked gone before
the next starts. A system that fails to start is recorded as such and the others go
on. The report is written to a temporary folder beside ``--output-dir`` and moved
into place only when complete; bad input fails before anything starts.
"""

from __future__ import annotations

import argparse
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench.launch import RunningSystem, StartupError
from pdserve.bench.report import (
    CompareReport,
    RateRun,
    SystemResult,
    machine_info,
    rate_label,
    versions,
    write_report,
)
from pdserve.bench.systems import (
    EngineSettings,
    SystemSpec,
    check_up_flags,
    parse_pdserve_entry,
    pdserve_up,
    vllm_aggregated,
    vllm_disagg,
)

DEFAULT_RATES = "0.5,1,1.5"
# Workload flags handed to every `pdserve bench run` as given (its contract's flags).
PASSTHROUGH: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--endpoint", {"choices": ("completions", "chat")}),
    ("--workload", {"choices": ("random", "chat-mix", "shared-prefix", "sharegpt")}),
    ("--input-len", {"type": int}), ("--output-len", {"type": int}),
    ("--range-ratio", {"type": float}), ("--mix", {}),
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
    dtype_requested: str


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "compare", help="aggregated vLLM vs pdserve (and vLLM's own P/D) on the same cores, "
        "same workload and rates; one report", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=None, help="local HF model folder (default: pdserve's "
                   "bundled SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16",
                                                       "float16"),
                   help="every engine's dtype; auto is resolved once as pdserve does "
                   "(float32 on CPUs without native bf16)")
    p.add_argument("--kv-cache-gib", type=int, default=2, help="KV cache per engine (GiB)")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--request-rates", default=DEFAULT_RATES,
                   help="comma-separated req/s ('inf': all at once); one run per rate")
    p.add_argument("--pdserve", action="append", metavar="NAME='FLAGS'",
                   help="a pdserve configuration: a name and `pdserve up` flags, e.g. "
                   "split='--cpu-layout split'; repeatable (default: default='')")
    p.add_argument("--with-vllm-disagg", action="store_true",
                   help="also run vLLM's own disaggregated serving (NixlConnector)")
    p.add_argument("--no-vllm", action="store_true",
                   help="skip the aggregated vLLM baseline (no ratios then)")
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


def main(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench: error: {exc}", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop the systems, then exit
    try:
        report = run_compare(cfg)
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [s.name for s in report.systems if s.error]
    print(f"report: {cfg.output_dir}/report.md" + (
        f" ({', '.join(failed)} failed to start)" if failed else ""))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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
    from pdserve.bench.metrics import Slo
    from pdserve.bench.workloads import check_workload_flags

    parser = argparse.ArgumentParser(prog="pdserve bench run")
    add_run_flags(parser)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["--base-url", "http://127.0.0.1:1", *argv])
    except SystemExit:
        lines = err.getvalue().strip().splitlines()
        raise ValueError(lines[-1] if lines else "bad workload flags") from None
    Slo.parse(args.slo)
    check_workload_flags(args)


def config_from_args(args: argparse.Namespace) -> CompareConfig:
    """Every check that can fail before a system starts."""
    from pdserve.model import resolve_model
    from pdserve.worker.engine import resolve_dtype

    rates = parse_rates(args.request_rates)
    entries = [parse_pdserve_entry(e) for e in (args.pdserve or ["default="])]
    names = [n for n, _ in entries] + ["vllm", "vllm-disagg"]
    if len(set(names)) != len(names):
        raise ValueError("--pdserve names must differ from each other and from 'vllm', "
                         "'vllm-disagg'")
    for name, flags in entries:
        check_up_flags(name, flags)
    check_workload(workload_args(args))
    if args.with_vllm_disagg:
        check_vllm_disagg()
    out = args.output_dir or Path("bench/results") / time.strftime("compare-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {out}: exists and is not an empty folder")
    model = resolve_model(args.model)
    settings = EngineSettings(str(model.path), model.served_name, resolve_dtype(args.dtype),
                              args.kv_cache_gib, args.max_model_len,
                              tuple(sorted(_affinity())))
    return CompareConfig(
        settings, rates, tuple(entries), not args.no_vllm, args.with_vllm_disagg,
        tuple(workload_args(args)), args.seed, args.slo, out, args.startup_timeout_s,
        args.run_timeout_s, args.stop_timeout_s, args.dtype)


def _affinity() -> set[int]:
    import os

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


def build_systems(cfg: CompareConfig) -> list[SystemSpec]:
    from pdserve.ports import free_port

    systems = []
    if cfg.with_vllm:
        systems.append(vllm_aggregated(cfg.settings, free_port()))
    if cfg.with_vllm_disagg:
        systems.append(vllm_disagg(cfg.settings, free_port(), (free_port(), free_port()),
                                   (free_port(), free_port())))
    for name, flags in cfg.pdserve:
        systems.append(pdserve_up(cfg.settings, free_port(), name, flags))
    return systems


def run_compare(cfg: CompareConfig) -> CompareReport:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    parent = cfg.output_dir.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.output_dir.name}-", dir=parent))
    try:
        results = [run_system(spec, cfg, tmp) for spec in build_systems(cfg)]
        report = CompareReport(
            settings=settings_json(cfg), machine=machine_info(), versions=versions(),
            rates=list(cfg.rates), systems=results, baseline="vllm" if cfg.with_vllm else None,
            started_at=started, finished_at=datetime.now(UTC).isoformat(timespec="seconds"))
        write_report(report, tmp)
        if cfg.output_dir.exists():
            cfg.output_dir.rmdir()  # checked empty up front
        tmp.rename(cfg.output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def settings_json(cfg: CompareConfig) -> dict[str, Any]:
    s = cfg.settings
    return {"model": s.served_name, "model_path": s.model_path, "dtype": s.dtype,
            "dtype_requested": cfg.dtype_requested, "kv_cache_gib": s.kv_cache_gib,
            "max_model_len": s.max_model_len, "enforce_eager": s.enforce_eager,
            "cores": list(s.cores), "seed": cfg.seed, "slo": cfg.slo,
            "request_rates": [rate_label(r) for r in cfg.rates],
            "workload_args": " ".join(cfg.workload_args), "command": sys.argv,
            "startup_timeout_s": cfg.startup_timeout_s, "run_timeout_s": cfg.run_timeout_s}


def _say(text: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_system(spec: SystemSpec, cfg: CompareConfig, tmp: Path) -> SystemResult:
    result = SystemResult(spec.name, spec.kind, spec.to_json())
    _say(f"{spec.name}: starting ({spec.kind}, cores {spec.cores})")
    running = RunningSystem(spec, tmp / "logs" / spec.name, cfg.stop_timeout_s)
    with running:
        try:
            result.startup_s = running.wait_ready(cfg.startup_timeout_s)
        except StartupError as exc:
            result.error = str(exc)
            _say(f"{spec.name}: failed to start: {exc}")
        else:
            _say(f"{spec.name}: ready in {result.startup_s:.1f} s")
            for rate in cfg.rates:
                gone = running.exited()
                run = RateRun(rate, error=gone) if gone else bench_run(spec, rate, cfg, tmp)
                result.runs.append(run)
                _say(f"{spec.name} at {rate_label(rate)} req/s: " + (
                    f"failed: {run.error}" if run.error else
                    f"{run.result.get('completed')}/{run.result.get('num_requests')} done"
                    if run.result else ""))
    stop = running.stop()
    result.stop = stop.to_json()
    _say(f"{spec.name}: stopped " + ("cleanly" if stop.clean else f"with SIGKILL "
                                      f"({len(stop.killed)} processes)"))
    return result


def bench_run(spec: SystemSpec, rate: float, cfg: CompareConfig, tmp: Path) -> RateRun:
    """One ``pdserve bench run`` (a subprocess: its CLI is the contract)."""
    out = tmp / "runs" / spec.name / f"rate-{rate_label(rate)}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "pdserve.cli", "bench", "run", "--base-url", spec.base_url,
            "--model", cfg.settings.served_name, "--tokenizer", cfg.settings.model_path,
            "--request-rate", rate_label(rate), "--result-json", str(out), "--no-progress",
            *cfg.workload_args]
    log = out.with_suffix(".log")
    try:
        with open(log, "w") as log_file:
            proc = subprocess.run(argv, stdout=log_file, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, timeout=cfg.run_timeout_s)
    except subprocess.TimeoutExpired:
        return RateRun(rate, error=f"bench run past --run-timeout-s {cfg.run_timeout_s:g}")
    if proc.returncode != 0 or not out.is_file():
        lines = log.read_text(errors="replace").strip().splitlines()
        return RateRun(rate, error=f"bench run exited {proc.returncode}: "
                       f"{lines[-1] if lines else 'no output'}")
    import json

    return RateRun(rate, result=json.loads(out.read_text()))
