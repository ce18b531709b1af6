"""A fault matrix under steady load: what clients see while a part of the cluster dies.

Starts ``pdserve up --with-etcd`` (vLLM workers, or ``--simulated``), captures each
prompt's greedy answer before any fault, then for each fault in turn runs
``--clients`` concurrent clients sending streamed greedy chat completions, injects
the fault ``--pre-s`` seconds in, waits until the router sees every worker healthy
again (at most ``--recover-s``), stops the clients, and reads each worker's load
(GetLoad) once it is idle. Faults (``--faults``):

- ``kill-prefill`` / ``kill-decode``: SIGKILL the worker process (its engine is left
  to the supervisor, which kills the group and restarts the worker);
- ``stop-decode``: SIGSTOP the decode worker's process group, SIGCONT after ``--stop-s``;
- ``kill-etcd``: SIGKILL the local etcd (``pdserve up`` starts it again);
- ``restart-router``: SIGTERM the router (the supervisor starts it again).

Per fault: requests sent, completed with the reference text, completed with another
text, errors the client saw (clean: an OpenAI error JSON or an SSE error event;
connection refused while the router is down; unclean: anything else, e.g. a stream
cut without an error event), requests still unanswered at ``--deadline-s`` (hung),
the recovery time, and what the workers still hold once idle (in-flight requests,
pending KV transfers, KV cache usage). Prints a table and writes JSON.

    HF_HUB_OFFLINE=1 pdserve bench faults --simulated --fault-s 8
    HF_HUB_OFFLINE=1 pdserve bench faults            # vLLM: ~15 min

``pdserve up`` starts and stops as ``pdserve bench compare``'s systems do
(``RunningSystem``); the faults themselves are signals to single processes.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from rich.console import Console
from rich.table import Table

from pdserve.bench.compare.launch import RunningSystem
from pdserve.bench.compare.systems import ProcSpec, SystemSpec
from pdserve.bench.micro.configs import FAULTS, FaultsConfig
from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret, load_cluster_secret, write_cluster_secret
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port
from pdserve.router.dispatch.workers.client import WorkerCallError, probe_load

PROMPTS = ("Name three colours.", "What is two plus two?", "Say hello in French.",
           "List the days of the week.", "What is the capital of Italy?")
console = Console(width=160)


@dataclass
class Outcome:
    kind: str  # correct | wrong | error_json | sse_error | refused | unclean | hung
    detail: str = ""


@dataclass
class FaultResult:
    fault: str
    outcomes: Counter[str] = field(default_factory=Counter)
    unclean: list[str] = field(default_factory=list)  # first few details
    recovery_s: float | None = None  # None: not recovered within --recover-s
    held_after: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def sent(self) -> int:
        return sum(self.outcomes.values())


# ---- the cluster -------------------------------------------------------------------

class Cluster:
    """``pdserve up up_argv`` (which serves on ``port``), started and stopped as bench
    compare's systems are: its own session, ready once it serves and the router sees
    every worker healthy; its output in ``log_dir/up.log``."""

    def __init__(self, up_argv: list[str], port: int, log_dir: Path, timeout_s: float) -> None:
        self.log = log_dir / "up.log"
        self.secret: ClusterSecret | None = None  # to probe the workers (--cluster-secret-file)
        argv = (sys.executable, "-m", "pdserve.cli.main", "up", *up_argv)
        spec = SystemSpec("pdserve-up", "pdserve", port,
                          (ProcSpec("up", argv, {"HF_HUB_OFFLINE": "1"}),), {})
        self.system = RunningSystem(spec, log_dir, stop_grace_s=60.0)
        self.system.__enter__()
        try:
            self.system.wait_ready(timeout_s)
        except Exception as exc:
            self.stop()
            raise RuntimeError(f"pdserve up did not start: {exc}; see {self.log}") from exc
        except BaseException:
            self.stop()
            raise
        self.root = spec.base_url
        self.base_url = f"{self.root}/v1"

    @property
    def pid(self) -> int:
        return self.system.procs["up"].pid

    def process(self, what: str) -> psutil.Process:
        """The ``pdserve up`` child that is ``what``: a worker id, ``router`` or ``etcd``."""
        for p in psutil.Process(self.pid).children():
            try:
                argv = p.cmdline()
            except psutil.NoSuchProcess:
                continue
            if what == "etcd" and argv and argv[0].endswith("etcd"):
                return p
            if what == "router" and argv[3:4] == ["router"]:
                return p
            if "--worker-id" in argv and argv[argv.index("--worker-id") + 1] == what:
                return p
        raise LookupError(f"no {what} process under pdserve up (pid {self.pid})")

    def workers(self) -> list[dict[str, Any]]:
        try:
            return list(httpx.get(self.root + "/workers", timeout=2).json()["workers"])
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def wait_all_healthy(self, num_workers: int, timeout_s: float) -> bool:
        def probe() -> str:
            healthy = sum(1 for w in self.workers() if w["healthy"])
            return "" if healthy >= num_workers else f"{healthy}/{num_workers} healthy"

        try:
            process.wait_ready(probe, timeout_s, retry_on=(httpx.HTTPError, ValueError))
        except process.NotReadyError:
            return False
        return True

    def stop(self) -> None:
        self.system.stop()


# ---- clients ------------------------------------------------------------------------

async def ask(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int,
              deadline_s: float, reference: str | None = None) -> tuple[Outcome, str]:
    """One streamed greedy chat completion, classified; (outcome, text)."""
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "temperature": 0,
            "max_tokens": max_tokens, "messages": [{"role": "user", "content": prompt}]}
    try:
        return await asyncio.wait_for(_stream(client, url, body, reference), deadline_s)
    except TimeoutError:
        return Outcome("hung"), ""
    except httpx.ConnectError as exc:
        return Outcome("refused", repr(exc)), ""
    except httpx.HTTPError as exc:
        return Outcome("unclean", repr(exc)), ""


async def _stream(client: httpx.AsyncClient, url: str, body: dict[str, Any],
                  reference: str | None) -> tuple[Outcome, str]:
    async with client.stream("POST", url + "/chat/completions", json=body) as reply:
        if reply.status_code != 200:
            raw = await reply.aread()
            try:
                error = json.loads(raw)["error"]
                return Outcome("error_json", f"{reply.status_code} {error.get('type')}"), ""
            except (ValueError, KeyError, TypeError):
                return Outcome("unclean", f"{reply.status_code} {raw[:200]!r}"), ""
        parts: list[str] = []
        async for line in reply.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                text = "".join(parts)
                ok = reference is None or text == reference
                return Outcome("correct" if ok else "wrong", text[:80]), text
            event = json.loads(data)
            if "error" in event:
                return Outcome("sse_error", str(event["error"].get("type"))), ""
            for choice in event.get("choices", ()):
                parts.append(choice.get("delta", {}).get("content") or "")
        return Outcome("unclean", "stream ended without [DONE] or an error event"), ""


async def drive(url: str, references: dict[str, str], args: FaultsConfig,
                stop: asyncio.Event, result: FaultResult) -> None:
    async def client_loop(k: int) -> None:
        async with httpx.AsyncClient(timeout=httpx.Timeout(args.deadline_s)) as client:
            i = k
            while not stop.is_set():
                prompt = PROMPTS[i % len(PROMPTS)]
                i += 1
                outcome, _ = await ask(client, url, prompt, args.max_tokens, args.deadline_s,
                                       references[prompt])
                result.outcomes[outcome.kind] += 1
                if outcome.kind in ("unclean", "wrong", "hung") and len(result.unclean) < 5:
                    result.unclean.append(f"{outcome.kind}: {outcome.detail}")
                if outcome.kind == "refused":  # the router is restarting: each retry counts
                    await asyncio.sleep(0.5)

    await asyncio.gather(*(client_loop(k) for k in range(args.clients)))


# ---- faults -------------------------------------------------------------------------

def inject(cluster: Cluster, fault: str, stop_s: float) -> threading.Timer | None:
    """Inject ``fault``; for ``stop-decode`` a timer that sends SIGCONT."""
    if fault == "kill-prefill":
        cluster.process("prefill-0").send_signal(signal.SIGKILL)
    elif fault == "kill-decode":
        cluster.process("decode-0").send_signal(signal.SIGKILL)
    elif fault == "stop-decode":
        pgid = cluster.process("decode-0").pid  # a session leader: its group is its pid
        process.signal_group(pgid, signal.SIGSTOP)
        timer = threading.Timer(stop_s, lambda: process.signal_group(pgid, signal.SIGCONT))
        timer.start()
        return timer
    elif fault == "kill-etcd":
        cluster.process("etcd").send_signal(signal.SIGKILL)
    elif fault == "restart-router":
        cluster.process("router").send_signal(signal.SIGTERM)
    else:
        raise ValueError(f"unknown fault {fault!r}; valid: {', '.join(FAULTS)}")
    return None


def held(cluster: Cluster, settle_s: float) -> dict[str, dict[str, float]]:
    """Each worker's in-flight requests, pending transfers and KV usage once idle
    (polled until all are zero or ``settle_s`` passes: leases expire after 30 s)."""
    deadline = time.monotonic() + settle_s
    while True:
        out: dict[str, dict[str, float]] = {}
        for w in cluster.workers():
            try:
                load = probe_load(w["endpoint"], timeout_s=2, secret=cluster.secret)
            except WorkerCallError as exc:
                out[w["id"]] = {"unreachable": 1.0, "error": float(len(exc.details) > 0)}
                continue
            out[w["id"]] = {"inflight": load.num_inflight_reqs,
                            "running": load.num_running_reqs,
                            "pending_transfers": load.num_pending_transfers,
                            "kv_cache_usage": round(load.kv_cache_usage, 4)}
        if all(v.get("inflight", 1) == 0 and v.get("pending_transfers", 1) == 0
               for v in out.values()) or time.monotonic() > deadline:
            return out
        time.sleep(0.5)


async def run_fault(cluster: Cluster, fault: str, references: dict[str, str],
                    args: FaultsConfig, num_workers: int) -> FaultResult:
    result = FaultResult(fault)
    stop = asyncio.Event()
    load = asyncio.create_task(drive(cluster.base_url, references, args, stop, result))
    await asyncio.sleep(args.pre_s)
    console.print(f"[bold]{fault}[/] ({result.sent} requests so far)")
    injected = time.monotonic()
    timer = await asyncio.to_thread(inject, cluster, fault, args.stop_s)
    await asyncio.sleep(args.fault_s)
    if timer is not None:
        timer.join(args.stop_s + 5)
    recovered = await asyncio.to_thread(cluster.wait_all_healthy, num_workers, args.recover_s)
    if recovered:
        result.recovery_s = round(time.monotonic() - injected, 1)
    await asyncio.sleep(args.post_s)  # load on the recovered cluster
    stop.set()
    await asyncio.wait_for(load, args.deadline_s + 10)  # each request has its deadline
    result.held_after = await asyncio.to_thread(held, cluster, args.settle_s)
    return result


# ---- report -------------------------------------------------------------------------

def report(results: list[FaultResult]) -> Table:
    table = Table(title="pdserve under faults (per fault: requests while it happened)")
    for column in ("fault", "sent", "correct", "wrong", "clean errors", "refused",
                   "unclean", "hung", "recovery s", "held after"):
        table.add_column(column, justify="left" if column in ("fault", "held after")
                         else "right")
    for r in results:
        o = r.outcomes
        held_text = ", ".join(
            f"{w}: {v.get('inflight', '?')} req/{v.get('pending_transfers', '?')} xfer"
            for w, v in r.held_after.items())
        table.add_row(r.fault, str(r.sent), str(o["correct"]), str(o["wrong"]),
                      str(o["error_json"] + o["sse_error"]), str(o["refused"]),
                      str(o["unclean"]), str(o["hung"]),
                      "-" if r.recovery_s is None else f"{r.recovery_s:.1f}", held_text)
    return table


async def main_async(args: FaultsConfig) -> int:
    log_dir = new_log_dir("faults-")
    num_workers = args.num_prefill + args.num_decode
    secret_file = write_cluster_secret(log_dir / "cluster-secret")  # to probe the workers
    port = free_port()
    up_argv = ["--with-etcd", "--port", str(port), "--num-prefill",
               str(args.num_prefill), "--num-decode", str(args.num_decode),
               "--disagg", "always", "--startup-timeout-s", str(args.startup_timeout_s),
               "--cluster-secret-file", str(secret_file)]
    if args.simulated:
        up_argv.append("--simulated")
    else:
        up_argv += ["--dtype", "float32"]
    console.print(f"pdserve up {' '.join(up_argv)}  (log {log_dir / 'up.log'})")
    cluster = Cluster(up_argv, port, log_dir, args.startup_timeout_s + 30)
    cluster.secret = load_cluster_secret(secret_file)
    results: list[FaultResult] = []
    try:
        if not cluster.wait_all_healthy(num_workers, 60):
            raise RuntimeError("not every worker healthy after start")
        references: dict[str, str] = {}
        async with httpx.AsyncClient(timeout=args.deadline_s) as client:
            for prompt in PROMPTS:
                outcome, text = await ask(client, cluster.base_url, prompt, args.max_tokens,
                                          args.deadline_s)
                if outcome.kind != "correct":
                    raise RuntimeError(f"reference request failed: {outcome}")
                references[prompt] = text
        for fault in args.faults:
            results.append(await run_fault(cluster, fault, references, args, num_workers))
            console.print(report(results[-1:]))
    finally:
        cluster.stop()
    console.print(report(results))
    out = Path(args.json or log_dir / "faults.json")
    out.write_text(json.dumps({"args": asdict(args), "results": [
        dict(asdict(r), outcomes=dict(r.outcomes), sent=r.sent) for r in results]},
        indent=2, default=str))
    for r in results:
        for detail in r.unclean:
            console.print(f"{r.fault}: {detail}")
    console.print(f"wrote {out}")
    return 0


def run(cfg: FaultsConfig) -> int:
    return asyncio.run(main_async(cfg))
