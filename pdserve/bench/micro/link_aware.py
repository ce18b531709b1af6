"""Link-aware disaggregation on hosts: a long-prompt mix through two routers over the
same workers, one with ``--link-aware`` and one with ``--no-link-aware``, in one run, with
prefill's link shaped to each rate in turn.

Each process runs on a host of its own (``pdserve.bench.hosts``: network namespaces, a
router namespace between them): etcd, a prefill and a decode worker (real vLLM), both
routers (``--disagg auto``) and the client. The links run at 10 Gbit/s, except prefill's,
which is shaped to each ``--link-gbit`` rate. Prefill's KV reaches decode only through
that link.

Per rate, each router serves ``--requests`` fresh prompts (random tokens, so nothing is
cached), of the ``--prompt-tokens`` lengths in turn, at ``--rate`` req/s (Poisson).
The two routers take turns, in an order that alternates from one rate to the next. A
warm-up request through the link-aware router first has decode measure the path at that
rate.

It reports, for each router:
- TTFT p50/p99. In pull mode the first token comes from prefill, so a transfer does not
  delay it.
- Time to the second token p50/p99: when the stream goes on after the handoff.
- ITL p99 and E2E p50.
- The decisions the router took (``pdserve:disagg_decisions_total``).
- The KV decode pulled (MB on the wire) and how many of its pulls came encoded
  (``--kv-compression lossless``: a thin path's handoffs move compressed).
- The prompt tokens each prefill computed. With ``--prefills 2`` a second prefill sits
  behind a 10 Gbit/s link that is never shaped: ``cache_aware`` placement with the paths
  priced sends the long prompts there, not across the thin link.

Results: ``bench/results/link-aware/`` (``results.json``, ``report.md``), or
``link-aware-<compression>/`` with a ``--kv-compression``, ``-2-prefills`` with
``--prefills 2``; ``--out`` names another folder under ``bench/results/``.

    sudo pdserve bench link-aware --link-gbit 1,0.1
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from pdserve.bench import hosts
from pdserve.bench.load.client import Endpoint
from pdserve.bench.load.metrics import RequestRecord, stats
from pdserve.bench.load.runner import Outcome, Runner, Schedule
from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.host_configs import LinkAwareConfig
from pdserve.bench.workload.prompts import BenchRequest, PromptEncoder
from pdserve.core import process
from pdserve.core.model import DEFAULT_MODEL_NAME, cache_dir, prepare_default_model
from pdserve.core.tokenizer import load_tokenizer
from pdserve.core.types import WorkerLoadReport
from pdserve.membership.local_etcd import LocalEtcd

FAST_GBIT = 10.0
FAST_PREFILL = "prefill-fast"  # --prefills 2: a second prefill, its link never shaped
WARMUPS = 8  # at most, until decode has measured every prefill's path
START_S = 600.0
ROUTERS = {"on": ("--link-aware", 8000), "off": ("--no-link-aware", 8001)}
GRPC_PORT, KV_PORT = 50051, 7000
DECISIONS = "pdserve:disagg_decisions_total"
console = Console()


def _pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli.main", *args]


class Cluster:
    """etcd, the workers and both routers, each on a host of its own."""

    def __init__(self, net: hosts.HostNet, config: LinkAwareConfig, log_dir: Path) -> None:
        self.net, self.config, self.log_dir = net, config, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.prefills = ("prefill", FAST_PREFILL) if config.prefills == 2 else ("prefill",)
        for name in ("etcd", "router", *self.prefills, "decode", "client"):
            net.add(name, FAST_GBIT)
        self.etcd = LocalEtcd(log_path=log_dir / "etcd.log", host=net.address("etcd"),
                              spawn=lambda argv, log: net.spawn("etcd", argv, log_path=log))

    def url(self, which: str) -> str:
        return f"http://{self.net.address('router')}:{ROUTERS[which][1]}"

    def start(self) -> None:
        self.net.call("client", self.etcd.start)
        env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_gib)}
        model = str(prepare_default_model())
        common = ("--etcd", self.etcd.url, "--cluster", "link-aware")
        for name in (*self.prefills, "decode"):
            role = "decode" if name == "decode" else "prefill"
            self._spawn(name, _pdserve(
                role, *common, "--host", self.net.address(name), "--port", str(GRPC_PORT),
                "--kv-port", str(KV_PORT), "--worker-id", name, "--model", model,
                "--dtype", self.config.dtype, "--kv-cache-gib", str(self.config.kv_cache_gib),
                "--kv-compression", self.config.kv_compression,
                "--max-model-len", str(max(self.config.lengths) + self.config.output_tokens
                                       + 64)), env)
        for which, (flag, port) in ROUTERS.items():
            self._spawn(f"router-{which}", _pdserve(
                "router", *common, "--host", self.net.address("router"), "--port", str(port),
                "--model", model, "--disagg", "auto", flag), env, host="router")
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if dead := [n for n, p in self.procs.items() if p.poll() is not None]:
                raise RuntimeError(f"{dead} exited: see {self.log_dir}")
            if all(self._ready(w) for w in ROUTERS):
                return
            time.sleep(1.0)
        raise RuntimeError(f"not ready in {START_S} s: see {self.log_dir}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str],
               host: str | None = None) -> None:
        self.procs[name] = self.net.spawn(host or name, argv, log_path=self.log_dir / f"{name}.log",
                                          env=env)

    def _ready(self, which: str) -> bool:
        def view() -> set[str]:
            try:
                workers = httpx.get(self.url(which) + "/workers", timeout=2).json()["workers"]
            except (httpx.HTTPError, ValueError, KeyError):
                return set()
            return {str(w["id"]) for w in workers if w["healthy"]}
        return self.net.call("client", view) >= {*self.prefills, "decode"}

    def decisions(self, which: str) -> dict[str, float]:
        """The router's decision counts, ``decision/reason`` -> count."""
        text = self.net.call("client", lambda: httpx.get(self.url(which) + "/metrics",
                                                         timeout=5).text)
        return {f"{s.labels['decision']}/{s.labels['reason']}": s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples if s.name == DECISIONS}

    def loads(self) -> dict[str, WorkerLoadReport]:
        """Each worker's ``GetLoad``, asked from the client host."""
        prober = self.net.prober("client")
        try:
            return {name: prober.load(f"{self.net.address(name)}:{GRPC_PORT}")
                    for name in (*self.prefills, "decode")}
        finally:
            prober.close()

    def counts(self) -> dict[str, float]:
        """Decode's KV pulled (wire bytes) and encoded pulls, and the prompt tokens each
        prefill computed, so far."""
        loads = self.loads()
        decode = loads["decode"]
        return {"bytes_received": decode.kv_bytes_received,
                "encoded_pulls": decode.kv_encoded_pulls,
                "encoded_bytes_saved": decode.kv_encoded_bytes_saved,
                **{f"{p}_tokens": loads[p].prompt_tokens_computed for p in self.prefills}}

    def measured_since(self, seconds: float) -> bool:
        """Decode has measured every prefill's path within the last ``seconds``."""
        links = {link.peer: link for link in self.loads()["decode"].kv_links}
        return all((link := links.get(f"{self.net.address(p)}:{KV_PORT}")) is not None
                   and link.age_s < seconds for p in self.prefills)

    def stop(self) -> None:
        process.stop(list(self.procs.values()), grace_s=10, sig=signal.SIGTERM)
        self.etcd.stop()


def _requests(encoder: PromptEncoder, config: LinkAwareConfig, seed: int
              ) -> list[BenchRequest]:
    """``config.requests`` fresh prompts of random tokens, the lengths in turn."""
    rng = random.Random(seed)
    vocab = encoder.vocab
    return [BenchRequest([], n, config.output_tokens, tuple(rng.choice(vocab) for _ in range(n)))
            for n in (config.lengths[i % len(config.lengths)] for i in range(config.requests))]


def _serve(ep: Endpoint, encoder: PromptEncoder, requests: list[BenchRequest],
           rate: float, seed: int) -> Outcome:
    """``requests`` at ``rate`` req/s (Poisson: the bench's own ``Runner``), on an event
    loop of the calling thread (one inside the client host)."""
    async def run() -> Outcome:
        async with httpx.AsyncClient(timeout=ep.timeout_s) as client:
            return await Runner(client, ep, encoder, None, False).run(requests, Schedule(
                len(requests), None, rate, 1.0, None, seed))
    return asyncio.run(run())


def _summary(records: list[RequestRecord], seconds: float,
             decisions: dict[str, float]) -> dict[str, Any]:
    done = [r for r in records if r.error is None and r.ttft_s is not None]
    second = [r.ttft_s + r.itls_s[0] for r in done if r.itls_s and r.ttft_s is not None]
    return {"requests": len(records), "failed": len(records) - len(done),
            "seconds": round(seconds, 2),
            "ttft_s": stats([r.ttft_s for r in done if r.ttft_s is not None]),
            "second_token_s": stats(second),
            "itl_s": stats([g for r in done for g in r.itls_s]),
            "e2e_s": stats([r.e2e_s for r in done if r.e2e_s is not None]),
            "decisions": decisions}


def _diff(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def measure(cluster: Cluster, encoder: PromptEncoder, config: LinkAwareConfig
            ) -> list[dict[str, Any]]:
    rows = []
    for i, rate in enumerate(config.link_rates):
        cluster.net.shape("prefill", rate)
        order = list(ROUTERS) if i % 2 == 0 else list(reversed(ROUTERS))
        shaped = time.monotonic()
        for w in range(WARMUPS):  # until decode has measured each path at this rate
            warm = _requests(encoder, config, seed=10_000 + 100 * i + w)[:1]
            ep = Endpoint(cluster.url("off" if w % 2 == 0 else "on") + "/v1",
                          DEFAULT_MODEL_NAME, "completions", ignore_eos=True,
                          timeout_s=config.request_timeout_s)
            cluster.net.call("client", functools.partial(_serve, ep, encoder, warm, 1.0, i))
            if cluster.measured_since(time.monotonic() - shaped):
                break
        time.sleep(3.0)  # the routers' next probe of decode brings the paths' prices
        for which in order:
            ep = Endpoint(cluster.url(which) + "/v1", DEFAULT_MODEL_NAME, "completions",
                          ignore_eos=True, timeout_s=config.request_timeout_s)
            seed = config.seed + 100 * i + (1 if which == "off" else 0)
            before, moved = cluster.decisions(which), cluster.counts()
            out = cluster.net.call(
                "client", functools.partial(_serve, ep, encoder,
                                            _requests(encoder, config, seed), config.rate, seed),
                timeout_s=config.request_timeout_s * 2 + config.requests / config.rate)
            row = {"link_gbit": rate, "link_aware": which,
                   **_summary(out.records, out.duration_s,
                              _diff(cluster.decisions(which), before)),
                   "kv": _diff(cluster.counts(), moved)}
            rows.append(row)
            _print(row)
    return rows


def _ms(stat: dict[str, float | None], key: str) -> str:
    value = stat.get(key)
    return "-" if value is None else f"{value * 1e3:.0f}"


def _print(row: dict[str, Any]) -> None:
    console.print(f"{row['link_gbit']:g} Gbit/s, link-aware {row['link_aware']}: TTFT p50/p99 "
                  f"{_ms(row['ttft_s'], 'p50')}/{_ms(row['ttft_s'], 'p99')} ms, 2nd token "
                  f"{_ms(row['second_token_s'], 'p50')}/{_ms(row['second_token_s'], 'p99')} "
                  f"ms, failed {row['failed']}, decisions {row['decisions']}, decode's KV "
                  f"{row['kv']}")


def report(rows: list[dict[str, Any]], config: LinkAwareConfig) -> str:
    lines = ["# Link-aware disaggregation on hosts (`pdserve bench link-aware`)", "",
             f"{config.requests} requests per router and rate, prompts of "
             f"{config.prompt_tokens} tokens, {config.output_tokens} output tokens, "
             f"{config.rate} req/s, dtype {config.dtype}, --kv-compression "
             f"{config.kv_compression}. Times in ms.", "",
             "| link Gbit/s | link-aware | TTFT p50 | TTFT p99 | 2nd token p50 | "
             "2nd token p99 | ITL p99 | E2E p50 | failed | decisions | KV pulled MB | "
             "encoded pulls | prompt tokens computed by prefill |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['link_gbit']:g} | {r['link_aware']} | {_ms(r['ttft_s'], 'p50')} | "
            f"{_ms(r['ttft_s'], 'p99')} | {_ms(r['second_token_s'], 'p50')} | "
            f"{_ms(r['second_token_s'], 'p99')} | {_ms(r['itl_s'], 'p99')} | "
            f"{_ms(r['e2e_s'], 'p50')} | {r['failed']} | "
            + ", ".join(f"{k} {v:g}" for k, v in sorted(r["decisions"].items()))
            + f" | {r.get('kv', {}).get('bytes_received', 0) / 1e6:.0f} | "
            f"{r.get('kv', {}).get('encoded_pulls', 0):g} | "
            + (", ".join(f"{k.removesuffix('_tokens')} {v:g}"
                         for k, v in sorted(r.get("kv", {}).items()) if k.endswith("_tokens"))
               or "-") + " |")
    by = {(r["link_gbit"], r["link_aware"]): r for r in rows}
    lines += ["", "On / off, per rate (below 1: link-aware is faster):", ""]
    for rate in config.link_rates:
        on, off = by.get((rate, "on")), by.get((rate, "off"))
        if on is None or off is None:
            continue
        parts = []
        for key, name in (("ttft_s", "TTFT"), ("second_token_s", "2nd token")):
            for p in ("p50", "p99"):
                a, b = on[key].get(p), off[key].get(p)
                if a is not None and b:
                    parts.append(f"{name} {p} {a / b:.2f}x")
        lines.append(f"- {rate:g} Gbit/s: " + ", ".join(parts))
    return "\n".join(lines) + "\n"


def run(config: LinkAwareConfig) -> int:
    if why := hosts.prepare_process():
        console.print(f"[red]link-aware needs hosts: {why}[/red]")
        return 2
    name = config.out or "link-aware" + (
        "" if config.kv_compression == "none" else f"-{config.kv_compression}") + (
        "-2-prefills" if config.prefills == 2 else "")
    out = RESULTS_DIR / name
    log_dir = Path(config.log_dir) if config.log_dir else cache_dir() / "bench-link-aware"
    shutil.rmtree(log_dir, ignore_errors=True)
    log_dir.mkdir(parents=True)
    encoder = PromptEncoder(load_tokenizer(prepare_default_model()), "completions")
    with hosts.HostNet() as net:
        cluster = Cluster(net, config, log_dir)
        try:
            cluster.start()
            rows = measure(cluster, encoder, config)
        finally:
            cluster.stop()
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"config": config.__dict__, "rows": rows},
                                                 indent=1))
    text = report(rows, config)
    (out / "report.md").write_text(text)
    console.print(text)
    return 0
