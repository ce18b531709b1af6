"""The KV transfer's share of TTFT in a real P/D run: pull versus layer-wise push.

Two setups, one after the other, each `pdserve`'s default layout (prefill and decode
share the cores): ``pull`` (``--no-kv-push``: decode pulls the KV after prefill ends)
and ``push`` (prefill sends each layer to the decode's inbox while computing; decode
copies it into its blocks). Per request, through the OpenAI client:

* TTFT and the time to the second token (TT2T) seen by the client;
* the *visible* transfer: how long the decode request waited for its KV after
  reaching the decode worker (the decode's ``kv_load_time_ns`` / ``kv_loads``), i.e.
  the part of the transfer not hidden behind prefill compute;
* its share of TTFT, and push ÷ pull of that share.

    pdserve bench transfer-pd --tokens 1024 --reps 5
    pdserve bench transfer-pd --tls    # also push over mutual TLS: TTFT and TT2T ratios

``--tls`` adds a third setup, ``push+tls``: push with every cluster connection (gRPC and
KV) under mutual TLS, certificates from a throwaway CA (``pdserve certs``); the report
adds its TTFT and TT2T over push's (target: TTFT within 5 %).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from openai import OpenAI
from rich.console import Console
from rich.table import Table

from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import TransferPdConfig
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.bench.micro.ttft import build_prompts, get_load
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.model import new_log_dir, prepare_default_model

TLS_TTFT_TARGET = 1.05  # TLS adds at most 5 % to TTFT
SHARE_TARGET = 0.10  # transfer ≤ 10 % of TTFT for a 1k-token prompt
CUT_TARGET = 0.5  # push cuts the visible share by ≥ 50 %
console = Console()


@dataclass
class ModeResult:
    mode: str
    ttft_s: list[float] = field(default_factory=list)
    tt2t_s: list[float] = field(default_factory=list)
    visible_s: list[float] = field(default_factory=list)
    push_loads: int = 0
    push_fallbacks: int = 0
    layers_pushed: int = 0

    def median(self, name: str) -> float:
        return statistics.median(getattr(self, name))

    @property
    def share(self) -> float:
        return statistics.median(v / t for v, t in zip(self.visible_s, self.ttft_s, strict=True))


def plan(mode: str, dtype: str, port_base: int, log_dir: Path,
         tls: TlsFiles | None = None) -> list[Proc]:
    py = [sys.executable, "-m", "pdserve.cli.main"]
    cores = f"0-{(os.cpu_count() or 1) - 1}"  # pdserve up's default layout: shared cores
    push = ["--no-kv-push"] if mode == "pull" else ["--kv-push"]
    security = tls.flags() if tls is not None else []
    children = []
    for role, offset in (("prefill", 1), ("decode", 3)):
        port = port_base + offset
        argv = py + [role, "--dtype", dtype, "--port", str(port), "--kv-port", str(port + 1),
                     "--worker-id", f"{role}-0", "--kv-cache-gib", "1", "--cpu-cores", cores,
                     *push, *security]
        children.append(Proc(role, tuple(argv), log_dir / f"{mode}-{role}.log",
                             f"grpc:127.0.0.1:{port}", tls.load() if tls else None))
    router = py + ["router", "--port", str(port_base), "--prefill", f"127.0.0.1:{port_base + 1}",
                   "--decode", f"127.0.0.1:{port_base + 3}", "--disagg", "always", *security]
    children.append(Proc("router", tuple(router), log_dir / f"{mode}-router.log",
                         f"http://127.0.0.1:{port_base}/health"))
    return children


def stream_times(client: OpenAI, model: str, prompt: str, max_tokens: int) -> tuple[float, float]:
    """(TTFT, time to the second token) of one streamed completion."""
    started = time.perf_counter()
    seen: list[float] = []
    stream = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            seen.append(time.perf_counter() - started)
    if len(seen) < 2:
        raise RuntimeError("the stream carried fewer than two tokens")
    return seen[0], seen[1]


def run_mode(mode: str, args: TransferPdConfig, prompts: list[str], log_dir: Path
             ) -> ModeResult:
    port_base = args.port_base + {"pull": 0, "push": 10}.get(mode, 20)
    tls = make_test_ca(log_dir / "tls") if mode.endswith("+tls") else None
    grpc_tls = tls.load() if tls is not None else None
    with ProcGroup(plan(mode, args.dtype, port_base, log_dir, tls)) as group:
        group.wait_ready(900)
        client = OpenAI(base_url=f"http://127.0.0.1:{port_base}/v1", api_key="x", timeout=300)
        model = client.models.list().data[0].id
        decode, prefill = f"127.0.0.1:{port_base + 3}", f"127.0.0.1:{port_base + 1}"
        stream_times(client, model, prompts[-1], 4)  # warm-up
        result = ModeResult(mode)
        for prompt in prompts[: args.reps]:
            before = get_load(decode, grpc_tls)
            ttft, tt2t = stream_times(client, model, prompt, args.max_tokens)
            after = get_load(decode, grpc_tls)
            loads = after.kv_loads - before.kv_loads
            if loads != 1:
                raise RuntimeError(f"{mode}: expected one KV load per request, saw {loads}")
            result.ttft_s.append(ttft)
            result.tt2t_s.append(tt2t)
            result.visible_s.append((after.kv_load_time_ns - before.kv_load_time_ns) / 1e9)
            result.push_loads += after.kv_push_loads - before.kv_push_loads
            result.push_fallbacks += after.kv_push_fallbacks - before.kv_push_fallbacks
        result.layers_pushed = get_load(prefill, grpc_tls).kv_layers_pushed
        return result


def report(results: dict[str, ModeResult], tokens: int) -> dict[str, float]:
    table = Table(title=f"KV transfer in P/D, {tokens}-token prompt (medians)")
    for col in ("mode", "TTFT ms", "TT2T ms", "visible transfer ms", "share of TTFT",
                "push loads / fallbacks"):
        table.add_column(col, justify="right")
    for r in results.values():
        table.add_row(r.mode, f"{r.median('ttft_s') * 1e3:.0f}", f"{r.median('tt2t_s') * 1e3:.0f}",
                      f"{r.median('visible_s') * 1e3:.2f}", f"{r.share:.2%}",
                      f"{r.push_loads} / {r.push_fallbacks}")
    console.print(table)
    pull, push = results["pull"], results["push"]
    ratios = {"pull_share": pull.share, "push_share": push.share,
              "push_over_pull_visible": push.median("visible_s") / pull.median("visible_s"),
              "push_over_pull_tt2t": push.median("tt2t_s") / pull.median("tt2t_s"),
              "push_over_pull_ttft": push.median("ttft_s") / pull.median("ttft_s")}
    console.print(f"transfer share of TTFT: pull {pull.share:.2%}, push {push.share:.2%} "
                  f"(target ≤ {SHARE_TARGET:.0%})")
    console.print(f"push ÷ pull: visible transfer {ratios['push_over_pull_visible']:.2f} "
                  f"(target ≤ {1 - CUT_TARGET:.2f}), TT2T {ratios['push_over_pull_tt2t']:.2f}, "
                  f"TTFT {ratios['push_over_pull_ttft']:.2f}")
    if (tls := results.get("push+tls")) is not None:
        ratios["tls_over_push_ttft"] = tls.median("ttft_s") / push.median("ttft_s")
        ratios["tls_over_push_tt2t"] = tls.median("tt2t_s") / push.median("tt2t_s")
        ok = "meets" if ratios["tls_over_push_ttft"] <= TLS_TTFT_TARGET else "MISSES"
        console.print(f"push+tls ÷ push: TTFT {ratios['tls_over_push_ttft']:.3f} ({ok} the "
                      f"{TLS_TTFT_TARGET:.2f} target), TT2T {ratios['tls_over_push_tt2t']:.3f}")
    return ratios


def run_pd(tokens: int, reps: int, max_tokens: int = 8, dtype: str = "auto",
           port_base: int = 19300) -> dict[str, object]:
    """Both modes, one after the other; the report's ratios and the raw results."""
    return run_config(TransferPdConfig(tokens, reps, max_tokens, dtype, port_base))


def run_config(args: TransferPdConfig) -> dict[str, object]:
    """``run_pd`` of a config."""
    tokens, reps = args.tokens, args.reps
    prepare_default_model()
    log_dir = new_log_dir("bench-transfer-pd-")
    prompts = build_prompts(reps + 1, tokens)
    modes = ("pull", "push", "push+tls") if args.tls else ("pull", "push")
    results = {mode: run_mode(mode, args, prompts, log_dir) for mode in modes}
    ratios = report(results, tokens)
    console.print(f"logs in {log_dir}")
    return {"args": asdict(args), "ratios": ratios,
            "results": {k: asdict(v) for k, v in results.items()}}


def run(cfg: TransferPdConfig) -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = RESULTS_DIR / f"transfer-pd-{time.strftime('%Y%m%d-%H%M%S')}.json"
    result = run_config(cfg)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    console.print(f"wrote {out}")
    return 0
