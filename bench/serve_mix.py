"""pdserve vs one aggregated vLLM on the same cores, under an open-loop chat mix.

Superseded: the load is ``pdserve bench run --workload chat-mix`` (the same 70/30 mix by
default, exact token counts, vLLM's metric definitions), the systems side by side are
``pdserve bench compare``. Kept to reproduce the results it wrote.

Each system starts alone on this machine (the others stopped), gets one warm-up
request, then for each rate a Poisson stream of chat requests (streamed, greedy,
``ignore_eos`` so output lengths are fixed): ``--short-share`` of them ~``--short-tokens``
prompt tokens x ``--short-out`` output tokens, the rest ~``--long-tokens`` x
``--long-out``. Every prompt is new (no prefix is shared between requests).

Systems (``--systems``): ``vllm`` (``vllm serve``: one aggregated engine on every
core), ``vllm-nospin`` (the same with its shared-memory queue readers not spinning:
what pdserve's vLLM plugin does in its own engines), and ``pd-<mode>``
(``pdserve up --disagg <mode>``, default flags otherwise;
``pd-<mode>@<layout>`` adds ``--cpu-layout <layout>``). For pdserve it also reports
the mean time per request in each phase of the router's timeline histogram.

Per system and rate it prints completed req/s, TTFT p50/p99, TPOT p50, ITL p50/p99
and goodput (requests/s meeting both SLOs; default TTFT <= 2 s, TPOT <= 100 ms, or
``--slo-from-agg K``: K x the aggregated engine's unloaded TTFT/TPOT measured in
this run), then each pdserve system's ratio to ``vllm`` at the same rate.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/serve_mix.py --rates 0.5 1.0 1.5 --num 40
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from pdserve.core.model import cache_dir, prepare_default_model
from pdserve.launch.up import free_port

MODEL = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 600
REQUEST_TIMEOUT_S = 900
console = Console(width=170)


@dataclass(frozen=True)
class Job:
    prompt: str
    max_tokens: int
    kind: str  # "short" | "long"


@dataclass
class Sample:
    kind: str
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itls_s: list[float] = field(default_factory=list)
    num_out: int = 0
    disagg: str = ""

    @property
    def tpot_s(self) -> float:
        return (self.e2e_s - self.ttft_s) / (self.num_out - 1) if self.num_out > 1 else 0.0


@dataclass
class RateResult:
    system: str
    rate: float
    duration_s: float
    samples: list[Sample]
    # pdserve only: mean seconds per request in each timeline phase (router's histogram)
    phases: dict[str, float] = field(default_factory=dict)

    def summary(self, slo_ttft_s: float, slo_tpot_s: float) -> dict[str, float]:
        ok = [s for s in self.samples if s.ok]
        itls = [x for s in ok for x in s.itls_s]
        good = [s for s in ok if s.ttft_s <= slo_ttft_s and s.tpot_s <= slo_tpot_s]
        return {
            "completed_rps": len(ok) / self.duration_s,
            "failed": len(self.samples) - len(ok),
            "ttft_p50_s": _pct([s.ttft_s for s in ok], 50),
            "ttft_p99_s": _pct([s.ttft_s for s in ok], 99),
            "tpot_p50_s": _pct([s.tpot_s for s in ok if s.num_out > 1], 50),
            "itl_p50_s": _pct(itls, 50),
            "itl_p99_s": _pct(itls, 99),
            "goodput_rps": len(good) / self.duration_s,
            "local_share": (sum(s.disagg.startswith("local") for s in ok) / len(ok)) if ok else 0,
        }


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def build_jobs(args: argparse.Namespace, n: int, seed: int) -> list[Job]:
    """``n`` chat requests of the mix, each prompt new (a unique opening)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(prepare_default_model())
    rng = random.Random(seed)
    words = tok.decode(list(range(1000, 9000))).split()
    jobs = []
    for i in range(n):
        short = rng.random() < args.short_share
        target = args.short_tokens if short else args.long_tokens
        text = f"Request {seed}-{i}: " + " ".join(rng.choice(words) for _ in range(target))
        ids = tok.encode(text, add_special_tokens=False)[: max(8, target - 20)]
        jobs.append(Job(tok.decode(ids), args.short_out if short else args.long_out,
                        "short" if short else "long"))
    return jobs


async def one_request(client: httpx.AsyncClient, url: str, job: Job) -> Sample:
    body = {"model": MODEL, "messages": [{"role": "user", "content": job.prompt}],
            "max_tokens": job.max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    sample = Sample(job.kind, ok=False)
    last = start
    try:
        async with client.stream("POST", url, json=body) as resp:
            sample.disagg = resp.headers.get("x-pdserve-disagg", "")
            if resp.status_code != 200:
                await resp.aread()
                return sample
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                choices = chunk.get("choices") or []
                if choices and (choices[0].get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if sample.ttft_s == 0.0:
                        sample.ttft_s = now - start
                    else:
                        sample.itls_s.append(now - last)
                    last = now
                if chunk.get("usage"):
                    sample.num_out = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError:
        return sample
    sample.e2e_s = time.perf_counter() - start
    sample.ok = sample.ttft_s > 0
    return sample


async def run_rate(base: str, jobs: list[Job], rate: float, seed: int
                   ) -> tuple[float, list[Sample]]:
    """Send ``jobs`` open-loop at Poisson ``rate``; the duration is first send to last end."""
    rng = random.Random(seed)
    url = f"{base}/v1/chat/completions"
    limits = httpx.Limits(max_connections=len(jobs) + 4)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for job in jobs:
            tasks.append(asyncio.create_task(one_request(client, url, job)))
            await asyncio.sleep(rng.expovariate(rate))
        samples = await asyncio.gather(*tasks)
    return time.perf_counter() - start, list(samples)


def phase_totals(base: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of ``pdserve:request_phase_seconds`` per phase; {} from vLLM."""
    try:
        text = httpx.get(f"{base}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        for kind, index in (("_sum{", 0), ("_count{", 1)):
            if line.startswith("pdserve:request_phase_seconds" + kind):
                phase = line.split('phase="', 1)[1].split('"', 1)[0]
                out.setdefault(phase, [0.0, 0.0])[index] = float(line.rsplit(" ", 1)[1])
    return {k: (v[0], v[1]) for k, v in out.items()}


def phase_means(before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
                ) -> dict[str, float]:
    means = {}
    for phase, (total, count) in after.items():
        t0, c0 = before.get(phase, (0.0, 0.0))
        if count > c0:
            means[phase] = (total - t0) / (count - c0)
    return means


def launch(system: str, port: int, log: Path, dtype: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE="2",
               PDSERVE_CACHE=str(cache_dir()))
    if system in ("vllm", "vllm-nospin"):
        if system == "vllm-nospin":  # pdserve's vLLM plugin, installed here, does it
            env["PDSERVE_VLLM_SHM_SPIN_S"] = "0"
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(prepare_default_model()), "--served-model-name", MODEL,
                "--dtype", dtype, "--max-model-len", "4096", "--enforce-eager",
                "--port", str(port), "--host", "127.0.0.1"]
    else:
        mode, _, layout = system.removeprefix("pd-").partition("@")
        argv = [sys.executable, "-m", "pdserve.cli.main", "up", "--dtype", dtype,
                "--port", str(port), "--disagg", mode]
        if layout:
            argv += ["--cpu-layout", layout]
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)


def wait_up(base: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{base}/v1/models", timeout=2).status_code == 200 and httpx.post(
                    f"{base}/v1/chat/completions", timeout=60, json={
                        "model": MODEL, "max_tokens": 2,
                        "messages": [{"role": "user", "content": "warm up"}]}
                    ).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError("server not ready")


def stop(proc: subprocess.Popen[bytes]) -> None:
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=40)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def unloaded(base: str, args: argparse.Namespace) -> tuple[float, float, float]:
    """Requests alone, one after another: a short one's (TTFT, TPOT), for SLOs derived
    from this run, and the median TTFT of ``--single-reps`` ~``--single-tokens``-token
    prompts (x 16 output tokens)."""
    job = build_jobs(argparse.Namespace(**{**vars(args), "short_share": 1.0}), 1, 999)[0]
    sample = asyncio.run(run_rate(base, [job], 1.0, 0))[1][0]
    single = argparse.Namespace(**{**vars(args), "short_share": 1.0, "short_out": 16,
                                   "short_tokens": args.single_tokens})
    ttfts = []
    for job in build_jobs(single, args.single_reps, 998):
        ttfts.append(asyncio.run(run_rate(base, [job], 1.0, 0))[1][0].ttft_s)
    return sample.ttft_s, sample.tpot_s, _pct(ttfts, 50)


def run_system(system: str, args: argparse.Namespace, log_dir: Path
               ) -> tuple[list[RateResult], tuple[float, float, float]]:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    proc = launch(system, port, log_dir / f"{system}.log", args.dtype)
    results = []
    try:
        wait_up(base, proc)
        idle = unloaded(base, args)
        console.print(f"[bold]{system}[/] up; unloaded TTFT {idle[0]:.3f} s, TPOT {idle[1]:.3f} s"
                      f", {args.single_tokens}-token prompt TTFT p50 {idle[2]:.3f} s")
        for i, rate in enumerate(args.rates):
            jobs = build_jobs(args, args.num, seed=100 + i)
            before = phase_totals(base)
            duration, samples = asyncio.run(run_rate(base, jobs, rate, seed=i))
            phases = phase_means(before, phase_totals(base))
            results.append(RateResult(system, rate, duration, samples, phases))
            console.print(f"  {rate} req/s: {sum(s.ok for s in samples)}/{len(samples)} ok "
                          f"in {duration:.0f} s")
            if phases:
                console.print("    mean s/request by phase: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in phases.items()))
    finally:
        stop(proc)
    return results, idle


def report(all_results: dict[str, list[RateResult]], slo: tuple[float, float]) -> dict[str, Any]:
    table = Table(title=f"chat mix (SLO TTFT <= {slo[0]:.2f} s, TPOT <= {slo[1] * 1e3:.0f} ms)")
    cols = ("completed_rps", "ttft_p50_s", "ttft_p99_s", "tpot_p50_s", "itl_p50_s",
            "itl_p99_s", "goodput_rps", "local_share", "failed")
    for c in ("system", "rate", *cols):
        table.add_column(c)
    out: dict[str, Any] = {}
    for system, results in all_results.items():
        for r in results:
            s = r.summary(*slo)
            out.setdefault(system, {})[str(r.rate)] = s
            table.add_row(system, str(r.rate), *(f"{s[c]:.3f}" for c in cols))
    console.print(table)
    if "vllm" in out:
        ratios = Table(title="ratio to aggregated vLLM at the same rate (targets: TTFT p50 <= 1.0, "
                             "goodput >= 1.0, ITL p99 <= 0.7 at the highest rate)")
        for c in ("system", "rate", "ttft_p50", "goodput", "itl_p99", "tpot_p50", "completed"):
            ratios.add_column(c)
        for system, by_rate in out.items():
            if system == "vllm":
                continue
            for rate, s in by_rate.items():
                b = out["vllm"].get(rate)
                if b is None:
                    continue
                def ratio(k: str, s: dict[str, float] = s, b: dict[str, float] = b) -> str:
                    return f"{s[k] / b[k]:.2f}" if b[k] else ("inf" if s[k] else "n/a")
                ratios.add_row(system, rate, ratio("ttft_p50_s"), ratio("goodput_rps"),
                               ratio("itl_p99_s"), ratio("tpot_p50_s"), ratio("completed_rps"))
        console.print(ratios)
    return out


def report_again(args: argparse.Namespace) -> None:
    saved = json.loads(args.from_file.read_text())
    results = {system: [RateResult(r["system"], r["rate"], r["duration_s"],
                                   [Sample(**x) for x in r["samples"]], r.get("phases", {}))
                        for r in runs]
               for system, runs in saved["samples"].items()}
    idle = saved["unloaded"]
    slo = (args.slo_ttft_s, args.slo_tpot_s)
    if args.slo_from_agg > 0 and "vllm" in idle:
        slo = (args.slo_from_agg * idle["vllm"][0], args.slo_from_agg * idle["vllm"][1])
    report(results, slo)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", nargs="+", default=["vllm", "pd-auto", "pd-always", "pd-never"])
    p.add_argument("--rates", nargs="+", type=float, default=[0.5, 1.0, 1.5])
    p.add_argument("--num", type=int, default=40, help="requests per rate")
    p.add_argument("--short-share", type=float, default=0.7)
    p.add_argument("--short-tokens", type=int, default=80)
    p.add_argument("--short-out", type=int, default=96)
    p.add_argument("--long-tokens", type=int, default=1200)
    p.add_argument("--long-out", type=int, default=16)
    p.add_argument("--single-tokens", type=int, default=500)
    p.add_argument("--single-reps", type=int, default=5)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--slo-ttft-s", type=float, default=2.0)
    p.add_argument("--slo-tpot-s", type=float, default=0.1)
    p.add_argument("--slo-from-agg", type=float, default=0.0,
                   help="if > 0: SLOs are this multiple of vllm's unloaded TTFT/TPOT")
    p.add_argument("--out", type=Path, default=Path("bench/results/serve_mix.json"))
    p.add_argument("--from", dest="from_file", type=Path,
                   help="report a previous run's --out again (e.g. with other SLOs); runs nothing")
    args = p.parse_args()
    if args.from_file is not None:
        report_again(args)
        return
    log_dir = args.out.parent / "serve_mix_logs"
    results: dict[str, list[RateResult]] = {}
    idle: dict[str, tuple[float, float, float]] = {}
    for system in args.systems:
        results[system], idle[system] = run_system(system, args, log_dir)
    slo = (args.slo_ttft_s, args.slo_tpot_s)
    if args.slo_from_agg > 0 and "vllm" in idle:
        slo = (args.slo_from_agg * idle["vllm"][0], args.slo_from_agg * idle["vllm"][1])
    summary = report(results, slo)
    for system, runs in results.items():
        for r in runs:
            if r.phases:
                console.print(f"{system} @ {r.rate}/s, mean s/request by phase: " + ", ".join(
                    f"{k} {v:.3f}" for k, v in r.phases.items()))
    if "vllm" in idle:
        for system, (_, _, ttft) in idle.items():
            console.print(f"single {args.single_tokens}-token prompt TTFT p50: {system} "
                          f"{ttft:.3f} s = {ttft / idle['vllm'][2]:.2f}x vllm (target <= 1.05)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                    "unloaded": idle, "slo": slo, "summary": summary,
                                    "samples": {s: [asdict(r) for r in rs]
                                                for s, rs in results.items()}}, indent=1))
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
