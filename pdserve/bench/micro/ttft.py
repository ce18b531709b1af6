"""TTFT and total time of one ~500-token prompt: P/D versus two aggregated baselines.

Setups, run one after another (each is stopped before the next starts):
  pd     1 prefill worker on core 0 + 1 decode worker on core 1
  agg-A  1 decode-only worker on cores 0-1 (the same two cores P/D uses)
  agg-B  1 decode-only worker on core 0 (the one core P/D's prefill gets)
Every setup gets the router; requests stream through the OpenAI client against
``/v1/completions``. Each repetition's prompt starts with different words, so prefix
caching cannot make later repetitions free. For P/D, the decode worker's ``GetLoad``
deltas around one extra request show the KV that was transferred instead of recomputed.

    pdserve bench ttft --reps 5 --dtype auto
"""

from __future__ import annotations

import json
import random
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from openai import OpenAI
from rich.console import Console
from rich.table import Table

from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import TtftConfig
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.core.grpc_tls import GrpcTls
from pdserve.core.model import new_log_dir, prepare_default_model
from pdserve.core.tokenizer import load_tokenizer
from pdserve.core.types import WorkerLoadReport
from pdserve.router.dispatch.workers.client import probe_load

TTFT_RATIO_TARGET = 1.1
STARTUP_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 300.0
console = Console()


@dataclass(frozen=True)
class Setup:
    name: str
    prefill_cores: str | None  # None: no prefill worker (aggregated)
    decode_cores: str


SETUPS = (
    Setup("pd-shared", "0,1", "0,1"),  # pdserve up's default: every engine on every core
    Setup("pd-split", "0", "1"),  # pdserve up --cpu-layout split
    Setup("agg-A", None, "0,1"),
    Setup("agg-B", None, "0"),
)
PD_SETUPS = ("pd-shared", "pd-split")


@dataclass
class SetupResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    num_completion_tokens: list[int] = field(default_factory=list)
    kv: dict[str, float] = field(default_factory=dict)

    @property
    def ttft_median_s(self) -> float:
        return statistics.median(self.ttft_s)

    @property
    def total_median_s(self) -> float:
        return statistics.median(self.total_s)


def build_prompts(num_prompts: int, num_tokens: int) -> list[str]:
    """Texts that tokenize (as the router does: special tokens added) to exactly ``num_tokens``."""
    tokenizer = load_tokenizer(prepare_default_model())
    rng = random.Random(0)
    words = ("river", "engine", "quiet", "market", "silver", "window", "planet", "garden",
             "signal", "harbor", "paper", "winter", "bridge", "forest", "copper", "lantern")
    body = " ".join(rng.choice(words) for _ in range(num_tokens * 2))
    prompts = []
    for i in range(num_prompts):
        lead = f"Request {i} ({words[i % len(words)]} {rng.randint(0, 10**6)}):"
        ids = tokenizer.encode(f"{lead} {body}", add_special_tokens=True)
        for cut in sorted(range(num_tokens - 8, num_tokens + 8), key=lambda c: abs(c - num_tokens)):
            # batch_decode: typed str per sequence (decode says str | list[str]); may not round-trip
            text = tokenizer.batch_decode([ids[:cut]], skip_special_tokens=True)[0]
            if len(tokenizer.encode(text, add_special_tokens=True)) == num_tokens:
                prompts.append(text)
                break
        else:
            raise RuntimeError(f"could not build a prompt of exactly {num_tokens} tokens")
    return prompts


def plan_setup(setup: Setup, dtype: str, port_base: int, log_dir: Path) -> list[Proc]:
    py = [sys.executable, "-m", "pdserve.cli.main"]
    children: list[Proc] = []
    endpoints: dict[str, str] = {"prefill": "", "decode": ""}
    roles = [("prefill", setup.prefill_cores, 1), ("decode", setup.decode_cores, 3)]
    for role, cores, offset in roles:
        if cores is None:
            continue
        port, kv_port = port_base + offset, port_base + offset + 1
        argv = py + [role, "--dtype", dtype, "--port", str(port), "--kv-port", str(kv_port),
                     "--cpu-cores", cores, "--worker-id", f"{role}-0"]
        endpoints[role] = f"127.0.0.1:{port}"
        children.append(Proc(f"{role}-0", tuple(argv), log_dir / f"{role}.log",
                             f"grpc:127.0.0.1:{port}"))
    # --disagg always: every setup with a prefill worker measures the handoff.
    router_argv = py + ["router", "--port", str(port_base), "--prefill", endpoints["prefill"],
                        "--decode", endpoints["decode"], "--disagg", "always"]
    children.append(Proc("router", tuple(router_argv), log_dir / "router.log",
                         f"http://127.0.0.1:{port_base}/health"))
    return children


class Timing(NamedTuple):
    ttft_s: float
    total_s: float
    num_prompt_tokens: int
    num_completion_tokens: int


def timed_request(client: OpenAI, model: str, prompt: str, max_tokens: int) -> Timing:
    """Time one streamed completion; token counts come from the final usage chunk."""
    started = time.perf_counter()
    ttft: float | None = None
    usage = (0, 0)
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            usage = (chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
    total = time.perf_counter() - started
    if ttft is None:
        raise RuntimeError("the stream carried no content")
    return Timing(ttft, total, *usage)


def get_load(target: str, tls: GrpcTls | None = None) -> WorkerLoadReport:
    return probe_load(target, timeout_s=5, tls=tls)


def kv_deltas(client: OpenAI, model: str, prompt: str, max_tokens: int,
              decode: str, prefill: str) -> dict[str, float]:
    """Decode/prefill counter deltas around one request; waits (bounded) for the transfer."""
    d0, p0 = get_load(decode), get_load(prefill)
    timed_request(client, model, prompt, max_tokens)
    deadline = time.monotonic() + 10.0
    d1 = get_load(decode)
    while d1.kv_transfers_completed == d0.kv_transfers_completed and time.monotonic() < deadline:
        time.sleep(0.1)
        d1 = get_load(decode)
    p1 = get_load(prefill)
    out: dict[str, float] = {
        name: getattr(d1, name) - getattr(d0, name)
        for name in ("kv_bytes_received", "kv_transfer_time_ns", "kv_transfers_completed",
                     "kv_transfers_failed", "prompt_tokens_external", "prompt_tokens_computed")
    }
    out["prefill_prompt_tokens_computed"] = p1.prompt_tokens_computed - p0.prompt_tokens_computed
    out["prefill_kv_bytes_sent"] = p1.kv_bytes_sent - p0.kv_bytes_sent
    seconds = out["kv_transfer_time_ns"] / 1e9
    out["kv_transfer_ms"] = seconds * 1e3
    out["kv_gb_per_s"] = out["kv_bytes_received"] / seconds / 1e9 if seconds > 0 else 0.0
    return out


def run_setup(setup: Setup, args: TtftConfig, prompts: list[str],
              log_dir: Path) -> SetupResult:
    group = ProcGroup(plan_setup(setup, args.dtype, args.port_base, log_dir / setup.name))
    result = SetupResult(setup.name)
    try:
        console.print(f"[bold]{setup.name}[/]: starting (logs {log_dir / setup.name})")
        group.start()
        group.wait_ready(STARTUP_TIMEOUT_S)
        client = OpenAI(base_url=f"http://127.0.0.1:{args.port_base}/v1", api_key="unused",
                        timeout=REQUEST_TIMEOUT_S, max_retries=0)
        model = client.models.list().data[0].id
        timed_request(client, model, prompts[0], args.max_tokens)  # warm-up
        for prompt in prompts[1:args.reps + 1]:
            t = timed_request(client, model, prompt, args.max_tokens)
            result.ttft_s.append(t.ttft_s)
            result.total_s.append(t.total_s)
            result.num_completion_tokens.append(t.num_completion_tokens)
            console.print(f"  ttft {t.ttft_s * 1e3:7.1f} ms  total {t.total_s * 1e3:7.1f} ms  "
                          f"tokens in/out {t.num_prompt_tokens}/{t.num_completion_tokens}")
            if (t.num_prompt_tokens, t.num_completion_tokens) != (args.prompt_tokens,
                                                                  args.max_tokens):
                console.print("  [red]unexpected token counts[/]")
        if setup.prefill_cores is not None:
            result.kv = kv_deltas(client, model, prompts[-1], args.max_tokens,
                                  f"127.0.0.1:{args.port_base + 3}",
                                  f"127.0.0.1:{args.port_base + 1}")
    finally:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a 2nd Ctrl-C must not
        try:                                                      # cut the cleanup short
            group.stop()
        finally:
            signal.signal(signal.SIGINT, previous)
    return result


def report(results: dict[str, SetupResult], args: TtftConfig) -> dict[str, float]:
    console.print(f"[bold]{args.prompt_tokens}-token prompt, {args.max_tokens} tokens out, "
                  f"median of {args.reps}, dtype {args.dtype}[/]")
    table = Table()
    for column in ("setup", "cores", "TTFT ms", "total ms", "TTFT min-max ms"):
        table.add_column(column, justify="left" if column in ("setup", "cores") else "right")
    cores = {s.name: f"P:{s.prefill_cores} D:{s.decode_cores}" if s.prefill_cores else
             f"D:{s.decode_cores}" for s in SETUPS}
    for name, r in results.items():
        table.add_row(name, cores[name], f"{r.ttft_median_s * 1e3:.1f}",
                      f"{r.total_median_s * 1e3:.1f}",
                      f"{min(r.ttft_s) * 1e3:.1f}-{max(r.ttft_s) * 1e3:.1f}")
    console.print(table)
    ratios: dict[str, float] = {}
    for name in PD_SETUPS:
        for base in ("agg-A", "agg-B"):
            ttft = results[name].ttft_median_s / results[base].ttft_median_s
            total = results[name].total_median_s / results[base].total_median_s
            ratios[f"ttft_{name}_over_{base}"], ratios[f"total_{name}_over_{base}"] = ttft, total
            ok = "[green]met" if ttft <= TTFT_RATIO_TARGET else "[red]missed"
            console.print(f"{name} ÷ {base}: TTFT {ttft:.2f} (target ≤ {TTFT_RATIO_TARGET}: "
                          f"{ok}[/]), total {total:.2f}")
    for name in PD_SETUPS:
        print_kv(name, results[name].kv)
    return ratios


def print_kv(name: str, kv: dict[str, float]) -> None:
    console.print(
        f"{name} KV transfer for one request: {kv['kv_bytes_received']:.0f} bytes in "
        f"{kv['kv_transfer_ms']:.2f} ms ({kv['kv_gb_per_s']:.2f} GB/s), "
        f"{kv['kv_transfers_completed']:.0f} transfer(s), {kv['kv_transfers_failed']:.0f} failed; "
        f"decode prompt tokens external {kv['prompt_tokens_external']:.0f} vs computed "
        f"{kv['prompt_tokens_computed']:.0f}; prefill computed "
        f"{kv['prefill_prompt_tokens_computed']:.0f}, sent {kv['prefill_kv_bytes_sent']:.0f} bytes")


def run(args: TtftConfig) -> int:
    def on_sigterm(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    log_dir = new_log_dir("bench-ttft-")
    prompts = build_prompts(args.reps + 2, args.prompt_tokens)  # warm-up + reps + KV probe
    results: dict[str, SetupResult] = {}
    try:
        for setup in SETUPS:
            results[setup.name] = run_setup(setup, args, prompts, log_dir)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted[/]; workers stopped")
        return 130
    ratios = report(results, args)
    out: dict[str, Any] = {
        "args": asdict(args), "timestamp": stamp, "logs": str(log_dir),
        "ttft_ratio_target": TTFT_RATIO_TARGET, "ratios": ratios,
        "setups": {s.name: {"setup": asdict(s), **asdict(results[s.name]),
                            "ttft_median_s": results[s.name].ttft_median_s,
                            "total_median_s": results[s.name].total_median_s} for s in SETUPS},
    }
    path = RESULTS_DIR / f"ttft-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    console.print(f"wrote {path}")
    return 0
