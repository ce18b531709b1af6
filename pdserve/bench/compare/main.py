"""``pdserve bench compare``: aggregated vLLM, optionally vLLM's own P/D, and pdserve
configurations, one after another on the same machine and cores, each driven by the
same seeded workload at the same rates (``pdserve bench run``); one report.

With ``--vllm-url`` the baseline is a vLLM server already running (``external.py``):
it gets the same runs, but compare neither starts nor stops it.

Each system is started alone (``launch.RunningSystem``), is ready once ``/v1/models``
answers and one warm request completes, gets one ``bench run`` per rate, and is
stopped (SIGTERM to its process groups, a deadline, SIGKILL) and checked gone before
the next starts. A system that fails to start is recorded as such and the others go
on. The report is written to a temporary folder beside ``--output-dir`` and moved
into place only when complete; bad input fails before anything starts.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from pdserve.bench.compare.config import CompareConfig
from pdserve.bench.compare.cost import Price, add_cost
from pdserve.bench.compare.external import port_of
from pdserve.bench.compare.launch import ExternalSystem, RunningSystem, StartupError
from pdserve.bench.compare.report import (
    CompareReport,
    RateRun,
    SystemResult,
    add_derived_goodput,
    derive_slo,
    machine_info,
    rate_label,
    versions,
)
from pdserve.bench.compare.roles_sampler import RoleSampler
from pdserve.bench.compare.systems import (
    SystemSpec,
    pdserve_up,
    vllm_aggregated,
    vllm_disagg,
    vllm_external,
)
from pdserve.bench.compare.worker_counters import counters_delta, read_counters
from pdserve.core import process
from pdserve.core.ports import free_port

__all__ = ["main", "report_writer", "run_compare"]
# Every ratio is to aggregated vLLM tuned as pdserve's engines are (systems.py), or to
# the running vLLM server --vllm-url names.
BASELINE = "vllm-tuned"
EXTERNAL_BASELINE = "vllm-external"
# Writes the report (JSON, Markdown, plots) into a folder: ``plots.write_report``.
ReportWriter = Callable[[CompareReport, Path], object]


def report_writer() -> ReportWriter:
    """``plots.write_report``; ModuleNotFoundError where matplotlib (the bench extra) is
    not installed. Imported here, not at the top: matplotlib is an optional dependency
    that only compare's plots need, so the rest of ``pdserve bench`` runs without it."""
    from pdserve.bench.compare.plots import write_report

    return write_report


def main(cfg: CompareConfig, write_report: ReportWriter) -> int:
    """Run ``cfg`` (checked when built: the CLI's ``compare_config``), write the report
    with ``write_report`` (``report_writer()``, got before anything starts) and print
    where it is."""
    _say(cfg.dtype.describe())
    previous = signal.signal(signal.SIGTERM, _interrupt)  # stop the systems, then exit
    try:
        report = run_compare(cfg, write_report)
    finally:
        signal.signal(signal.SIGTERM, previous)
    failed = [s.name for s in report.systems if s.error]
    print(f"report: {cfg.output_dir}/report.md" + (
        f" ({', '.join(failed)} failed to start)" if failed else ""))
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def baseline_of(cfg: CompareConfig) -> str | None:
    """The name of the system every ratio is to; None without aggregated vLLM."""
    if cfg.vllm_external is not None:
        return EXTERNAL_BASELINE
    return BASELINE if cfg.with_vllm else None


def build_systems(cfg: CompareConfig) -> list[SystemSpec]:
    systems = []
    if cfg.with_vllm:
        ext = cfg.vllm_external
        systems.append(
            vllm_aggregated(cfg.settings, free_port(), BASELINE, tuned=True) if ext is None
            else vllm_external(ext.url, port_of(ext.url), ext.card, EXTERNAL_BASELINE))
        if cfg.with_vllm_stock:
            systems.append(vllm_aggregated(cfg.settings, free_port()))
    if cfg.with_vllm_disagg:
        systems.append(vllm_disagg(cfg.settings, free_port(), (free_port(), free_port()),
                                   (free_port(), free_port()), command=cfg.pdserve_command))
    for name, flags in cfg.pdserve:
        systems.append(pdserve_up(cfg.settings, free_port(), name, flags,
                                  cfg.pdserve_command))
    return systems


def run_compare(cfg: CompareConfig, write_report: ReportWriter) -> CompareReport:
    started = datetime.now(UTC).isoformat(timespec="seconds")
    parent = cfg.output_dir.absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.output_dir.name}-", dir=parent))
    try:
        baseline = baseline_of(cfg)
        results = [run_system(spec, cfg, tmp, spec.name == baseline)
                   for spec in build_systems(cfg)]
        derived = derived_slos(results, baseline)
        if cfg.cost is not None:
            add_costs(results, cfg.cost, derived)
        report = CompareReport(
            settings=settings_json(cfg), machine=machine_info(), versions=versions(),
            rates=list(cfg.rates), systems=results,
            baseline=baseline,
            started_at=started, finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
            derived_slo=derived)
        write_report(report, tmp)
        if cfg.output_dir.exists():
            cfg.output_dir.rmdir()  # checked empty up front
        tmp.rename(cfg.output_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return report


def derived_slos(results: list[SystemResult], baseline: str | None = BASELINE
                 ) -> dict[str, float] | None:
    """The SLOs derived from the ``baseline``'s unloaded run, and every run's goodput
    under them (``goodput_derived``); None without that run."""
    base = next((r for r in results if r.name == baseline and r.unloaded is not None), None)
    if base is None or base.unloaded is None or base.unloaded.result is None:
        return None
    slo = derive_slo(base.unloaded.result)
    if slo is None:
        return None
    for system in results:
        for run in system.runs:
            if run.result is not None:
                add_derived_goodput(run.result, slo)
    return slo


def add_costs(results: list[SystemResult], price: Price,
              derived: dict[str, float] | None) -> None:
    """Every run's ``cost`` (``cost.py``) at ``price`` on what its system used (none for a
    system whose cores are not known: a simulated one); a request is within SLO by the
    derived SLOs where there are some, else by the run's own."""
    for system in results:
        hourly = price.hourly(system.spec)
        for run in system.runs:
            if run.result is not None and hourly is not None:
                add_cost(run.result, hourly, derived or run.result.get("slo"))


def settings_json(cfg: CompareConfig) -> dict[str, Any]:
    s = cfg.settings
    return {"model": s.served_name, "model_path": s.model_path, "dtype": s.dtype,
            "dtype_requested": cfg.dtype.requested, "dtype_reason": cfg.dtype.reason,
            "kv_cache_gib": s.kv_cache_gib, "num_kv_blocks": s.num_kv_blocks,
            "max_model_len": s.max_model_len, "enforce_eager": s.enforce_eager,
            "cores": list(s.cores), "seed": cfg.seed, "slo": cfg.slo,
            "request_rates": [rate_label(r) for r in cfg.rates],
            "workload_args": " ".join(cfg.workload_args), "command": sys.argv,
            "startup_timeout_s": cfg.startup_timeout_s, "run_timeout_s": cfg.run_timeout_s,
            "cost_per_hour": cfg.cost.to_json() if cfg.cost is not None else None,
            "vllm_url": cfg.vllm_external.url if cfg.vllm_external is not None else None}


def _say(text: str) -> None:
    print(f"[compare {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run_system(spec: SystemSpec, cfg: CompareConfig, tmp: Path,
               baseline: bool = False) -> SystemResult:
    """``spec`` started (an external one: only waited for), its runs (the ``baseline``
    first gets its unloaded run), stopped (an external one: left running)."""
    result = SystemResult(spec.name, spec.kind, spec.to_json())
    running: RunningSystem | ExternalSystem
    if spec.external:
        _say(f"{spec.name}: the running server at {spec.base_url} (compare neither "
             "starts nor stops it)")
        running = ExternalSystem(spec)
    else:
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
            if baseline:
                result.unloaded = unloaded_run(spec, cfg, tmp)
            for index, rate in enumerate(cfg.rates):
                gone = running.exited()
                run = (RateRun(rate, error=gone) if gone
                       else bench_run(spec, rate, index, cfg, tmp))
                result.runs.append(run)
                _say(f"{spec.name} at {rate_label(rate)} req/s: " + (
                    f"failed: {run.error}" if run.error else
                    f"{run.result.get('completed')}/{run.result.get('num_requests')} done"
                    if run.result else ""))
    stop = running.stop()
    result.stop = stop.to_json()
    _say(f"{spec.name}: " + ("left running (external)" if stop.external else
                             "stopped cleanly" if stop.clean else
                             f"stopped with SIGKILL ({len(stop.killed)} processes)"))
    return result


UNLOADED_REQUESTS = 8
# A bench run past its deadline (or interrupted) gets this long after SIGTERM.
BENCH_STOP_GRACE_S = 5.0


def unloaded_run(spec: SystemSpec, cfg: CompareConfig, tmp: Path) -> RateRun:
    """Lone requests of the workload, one at a time: the unloaded TTFT and ITL the
    derived SLOs come from."""
    out = tmp / "runs" / spec.name / "unloaded.json"
    args = rate_workload_args(cfg, len(cfg.rates))
    for flag in ("--num-requests", "--duration-s", "--max-concurrency"):
        while flag in args:
            at = args.index(flag)
            del args[at:at + 2]
    argv = bench_argv(spec, math.inf, len(cfg.rates), cfg, out)
    argv = argv[:argv.index("--no-progress") + 1] + args + [
        "--num-requests", str(UNLOADED_REQUESTS), "--max-concurrency", "1"]
    result, error = run_bench(argv, out, cfg.run_timeout_s)
    _say(f"{spec.name} unloaded: " + (f"failed: {error}" if error else "done"))
    return RateRun(math.inf, result=result, error=error)


def rate_workload_args(cfg: CompareConfig, index: int) -> list[str]:
    """The workload flags of the ``index``-th rate: its seed is ``--seed`` + index, so each
    rate sends prompts of its own (a server's prefix cache would otherwise answer a later
    rate's prompts from an earlier rate's run, which made the later rates look cheap) and
    every system gets the same ones."""
    args = list(cfg.workload_args)
    at = args.index("--seed") + 1
    args[at] = str(cfg.seed + index)
    return args


def bench_argv(spec: SystemSpec, rate: float, index: int, cfg: CompareConfig,
               out: Path) -> list[str]:
    return [*cfg.pdserve_command, "bench", "run", "--base-url", spec.base_url,
            "--model", cfg.settings.served_name, "--tokenizer", cfg.settings.model_path,
            "--request-rate", rate_label(rate), "--result-json", str(out), "--no-progress",
            *rate_workload_args(cfg, index)]


def bench_run(spec: SystemSpec, rate: float, index: int, cfg: CompareConfig,
              tmp: Path) -> RateRun:
    """One ``pdserve bench run`` at ``rate``."""
    out = tmp / "runs" / spec.name / f"rate-{rate_label(rate)}.json"
    if spec.kind != "pdserve":
        result, error = run_bench(bench_argv(spec, rate, index, cfg, out), out,
                                  cfg.run_timeout_s)
        return RateRun(rate, result=result, error=error)
    # pdserve: the roles its workers serve while the load runs (the planner's doing), and
    # what the workers counted (``worker_counters.py``).
    before = read_counters(spec.base_url)
    with RoleSampler(spec.base_url) as roles:
        result, error = run_bench(bench_argv(spec, rate, index, cfg, out), out,
                                  cfg.run_timeout_s)
    if result is not None:
        result["roles_timeline"] = roles.samples
        result["workers"] = counters_delta(before, read_counters(spec.base_url),
                                           int(result.get("completed") or 0))
    return RateRun(rate, result=result, error=error)


def run_bench(argv: list[str], out: Path, timeout_s: float
              ) -> tuple[dict[str, Any] | None, str | None]:
    """``argv`` (a ``pdserve bench run`` writing ``out``; a subprocess: its CLI is the
    contract), its log beside ``out``: the result JSON, or why there is none. Stopped
    (``pdserve.core.process.stop``) past ``timeout_s`` or when this process is
    interrupted."""
    out.parent.mkdir(parents=True, exist_ok=True)
    log = out.with_suffix(".log")
    log.write_bytes(b"")
    proc = process.spawn(argv, log_path=log)
    try:
        returncode = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return None, f"bench run past --run-timeout-s {timeout_s:g}"
    finally:
        if proc.poll() is None:
            process.stop([proc], BENCH_STOP_GRACE_S)
    if returncode != 0 or not out.is_file():
        lines = log.read_text(errors="replace").strip().splitlines()
        return None, f"bench run exited {returncode}: {lines[-1] if lines else 'no output'}"
    return json.loads(out.read_text()), None
