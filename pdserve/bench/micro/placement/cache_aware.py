"""Cache-aware vs round-robin placement on real vLLM, in the same run.

2 prefill workers (small KV caches: ``--num-kv-blocks``) + 1 decode worker start
once; for each phase a fresh router with the phase's policy. Phases:

  shared-prefix   S system prompts x U users x T turns; the distinct prefixes exceed
                  one prefill worker's KV cache but fit in both
  control         few system prompts: everything fits in one worker

each run with ``round_robin`` then ``cache_aware``. Every phase uses its own text
(seeded), so what an earlier phase cached cannot help. Reports the prefix hit rate
(engine counters: prompt tokens served from the prefill engines' prefix caches /
prompt tokens, from GetLoad before and after), TTFT p50/p99 and throughput, and
cache_aware / round_robin ratios against the targets (TTFT p50 <= 0.6x, hit rate
>= 1.5x; control ~ 1.0x).

    HF_HUB_OFFLINE=1 pdserve bench placement
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

import httpx

from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import PlacementConfig
from pdserve.bench.micro.placement.workload import Workload, run_workload
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.core.model import new_log_dir, prepare_default_model
from pdserve.core.ports import free_port
from pdserve.router.dispatch.workers.client import probe_load

MODEL = "SmolLM2-135M-Instruct"
POLICIES = ("round_robin", "cache_aware")


def worker_children(args: PlacementConfig, log_dir: Path) -> tuple[list[Proc], list[str],
                                                                   str]:
    py = [sys.executable, "-m", "pdserve.cli.main"]
    common = ["--max-model-len", str(args.max_model_len), "--dtype", args.dtype]
    children, prefill = [], []
    for i, role in enumerate(["prefill", "prefill", "decode"]):
        port = free_port()
        argv = py + [role, *common, "--port", str(port), "--kv-port", str(free_port()),
                     "--worker-id", f"bench-{role}-{i}"]
        argv += ["--kv-cache-gib", "1"]  # vLLM checks this much memory is free
        if role == "prefill":
            argv += ["--num-kv-blocks", str(args.num_kv_blocks)]
        children.append(Proc(f"{role}-{i}", tuple(argv), log_dir / f"{role}-{i}.log",
                             f"grpc:127.0.0.1:{port}"))
        if role == "prefill":
            prefill.append(f"127.0.0.1:{port}")
    return children, prefill, children[-1].probe.removeprefix("grpc:")


def engine_hits(endpoints: list[str]) -> tuple[int, int]:
    """(prompt tokens computed, prompt tokens from the prefix cache), both prefill workers."""
    computed = hit = 0
    for e in endpoints:
        load = probe_load(e, timeout_s=10)
        computed += load.prompt_tokens_computed
        hit += load.prompt_tokens_local_cache_hit
    return computed, hit


def run_phase(args: PlacementConfig, name: str, policy: str, workload: Workload,
              prefill: list[str], decode: str, log_dir: Path) -> dict[str, float]:
    port = free_port()
    router = Proc(f"router-{name}-{policy}", (
        sys.executable, "-m", "pdserve.cli.main", "router", "--port", str(port), "--placement",
        policy, "--prefill", ",".join(prefill), "--decode", decode, "--max-model-len",
        str(args.max_model_len), "--disagg", "always"),  # prefill placement is measured
        log_dir / f"router-{name}-{policy}.log",
        f"http://127.0.0.1:{port}/health")
    with ProcGroup([router]) as group:
        group.wait_ready(120)
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30  # the router's KV-event followers have synced
        while len(httpx.get(base + "/prefix_index").json()["resyncs"]) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("router did not subscribe to both prefill workers")
            time.sleep(0.5)
        before = engine_hits(prefill)
        stats = asyncio.run(run_workload(base + "/v1", MODEL, workload))
        after = engine_hits(prefill)
    computed, hit = after[0] - before[0], after[1] - before[1]
    out = dict(stats.summary(), engine_hit_rate=hit / max(hit + computed, 1),
               engine_tokens_computed=computed, engine_tokens_hit=hit)
    print(f"{name:13s} {policy:12s} hit {out['engine_hit_rate']:6.1%}  TTFT p50 "
          f"{out['ttft_p50_s']:6.2f}s p99 {out['ttft_p99_s']:6.2f}s  "
          f"{out['requests_per_s']:5.2f} req/s  {out['prompt_tokens_per_s']:6.0f} prompt tok/s"
          f"  ({out['requests']} req, {out['errors']} errors, load {os.getloadavg()[0]:.1f})",
          flush=True)
    return out


def ratios(res: dict[str, dict[str, float]]) -> dict[str, float]:
    rr, ca = res["round_robin"], res["cache_aware"]
    return {"ttft_p50": ca["ttft_p50_s"] / rr["ttft_p50_s"],
            "ttft_p99": ca["ttft_p99_s"] / rr["ttft_p99_s"],
            "hit_rate": ca["engine_hit_rate"] / max(rr["engine_hit_rate"], 1e-9),
            "throughput": ca["requests_per_s"] / rr["requests_per_s"]}


def run(args: PlacementConfig) -> int:
    prepare_default_model()
    log_dir = new_log_dir("bench-placement-")
    children, prefill, decode = worker_children(args, log_dir)
    phases = {
        "shared-prefix": [Workload(args.systems, args.users, args.turns, args.system_words,
                                   args.concurrency, args.max_tokens, seed=s) for s in (1, 2)],
        "control": [Workload(args.control_systems, args.users + 1, args.turns,
                             args.system_words, args.concurrency, args.max_tokens, seed=s)
                    for s in (3, 4)],
    }
    results: dict[str, dict[str, dict[str, float]]] = {}
    print(f"2 prefill workers x {args.num_kv_blocks} KV blocks of 128 tokens, 1 decode; "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; logs {log_dir}")
    with ProcGroup(children) as group:
        group.wait_ready(900)
        for name, workloads in phases.items():
            results[name] = {p: run_phase(args, name, p, w, prefill, decode, log_dir)
                             for p, w in zip(POLICIES, workloads, strict=True)}
    errors = sum(r["errors"] for res in results.values() for r in res.values())
    if errors:
        print(f"WARNING: {errors} requests failed; the numbers below are not comparable")
    summary = {name: ratios(res) for name, res in results.items()}
    for name, r in summary.items():
        print(f"{name:13s} cache_aware / round_robin: TTFT p50 {r['ttft_p50']:.2f}x, "
              f"p99 {r['ttft_p99']:.2f}x, hit rate {r['hit_rate']:.2f}x, "
              f"throughput {r['throughput']:.2f}x")
    print_targets(summary)
    out = RESULTS_DIR / time.strftime("placement-%Y%m%d-%H%M%S.json")
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": asdict(args), "results": results, "ratios": summary},
                              indent=2))
    print(f"results: {out}")
    return 0


def print_targets(summary: dict[str, dict[str, float]]) -> None:
    sp, ctl = summary["shared-prefix"], summary["control"]
    print(f"targets: TTFT p50 <= 0.6x: {sp['ttft_p50']:.2f}x "
          f"{'OK' if sp['ttft_p50'] <= 0.6 else 'MISSED'}; hit rate >= 1.5x: "
          f"{sp['hit_rate']:.2f}x {'OK' if sp['hit_rate'] >= 1.5 else 'MISSED'}; control "
          f"TTFT p50 {ctl['ttft_p50']:.2f}x, hit rate {ctl['hit_rate']:.2f}x (~1.0x)")
