"""``pdserve bench partitions``' cluster (``partitions.py`` runs the faults on it): etcd, a
router (``--placement round_robin --disagg always``), one prefill and two decode workers
(real vLLM) and the client, each on a host of its own (``pdserve.bench.hosts``); what the
bench reads of it (the router's view and metrics, each worker's ``GetLoad`` through one
prober on the client host, the registrations in etcd: ``whole``) and its streams."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.bench import hosts
from pdserve.bench.load.sse import sse_events, token_ids
from pdserve.bench.micro.host_configs import PartitionsConfig
from pdserve.core import process
from pdserve.core.model import prepare_default_model
from pdserve.core.types import WorkerLoadReport
from pdserve.membership.local_etcd import LocalEtcd, gateway_keys

CLUSTER = "partitions"
PREFIX = f"/pdserve/{CLUSTER}/workers/"
WORKERS = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
DECODES = ("decode-0", "decode-1")
ROUTER_PORT, GRPC_PORT, KV_PORT = 8000, 50051, 7000
START_S = 600.0
COUNTS = {"migrations": "pdserve:migrations_total",
          "prefill_fallbacks": "pdserve:prefill_fallbacks_total"}


def _pdserve(*args: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.cli.main", *args]


@dataclass
class Stream:
    """One stream's end: its token ids, the error it got ("" none), its seconds."""

    ids: list[int]
    error: str
    seconds: float


class Cluster:
    """etcd, the router, the workers and the client, each on a host of its own."""

    def __init__(self, net: hosts.HostNet, config: PartitionsConfig, log_dir: Path) -> None:
        self.net, self.config, self.log_dir = net, config, log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        for name in ("etcd", "router", *WORKERS, "client"):
            net.add(name, config.link_gbit)
        self.etcd = LocalEtcd(log_path=log_dir / "etcd.log", host=net.address("etcd"),
                              spawn=lambda argv, log: net.spawn("etcd", argv, log_path=log))
        self.url = f"http://{net.address('router')}:{ROUTER_PORT}"
        self.prober: hosts.Prober | None = None
        self.http = httpx.Client(timeout=5)

    def start(self) -> None:
        """Everything started, and every worker healthy in the router's view (the
        calling thread inside the client host)."""
        c = self.config
        self.etcd.start()
        self.prober = self.net.prober("client")
        env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "VLLM_CPU_KVCACHE_SPACE": str(c.kv_cache_gib)}
        model = str(prepare_default_model())
        common = ("--etcd", self.etcd.url, "--cluster", CLUSTER)
        for worker_id, role in WORKERS.items():
            self._spawn(worker_id, _pdserve(
                role, *common, "--host", self.net.address(worker_id), "--port",
                str(GRPC_PORT), "--kv-port", str(KV_PORT), "--worker-id", worker_id,
                "--model", model, "--dtype", c.dtype, "--kv-cache-gib", str(c.kv_cache_gib),
                "--etcd-ttl-s", str(c.etcd_ttl_s), "--kv-stall-s", str(c.kv_stall_s),
                "--lease-s", str(c.lease_s),
                "--max-model-len", str(c.prompt_tokens + c.output_tokens + 64)), env)
        self._spawn("router", _pdserve(
            "router", *common, "--host", self.net.address("router"), "--port",
            str(ROUTER_PORT), "--model", model, "--placement", "round_robin", "--disagg",
            "always"), env)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if dead := [n for n, p in self.procs.items() if p.poll() is not None]:
                raise RuntimeError(f"{dead} exited: see {self.log_dir}")
            if self.healthy() >= set(WORKERS):
                return
            time.sleep(1.0)
        raise RuntimeError(f"not ready in {START_S} s: see {self.log_dir}")

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.procs[name] = self.net.spawn(name, argv, log_path=self.log_dir / f"{name}.log",
                                          env=env)

    def healthy(self) -> set[str]:
        try:
            workers = self.http.get(self.url + "/workers").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {str(w["id"]) for w in workers if w["healthy"]}

    def metric(self, name: str) -> float | None:
        """The sum of the router's samples ``name`` (None: unreachable or absent)."""
        try:
            text = self.http.get(self.url + "/metrics").text
        except httpx.HTTPError:
            return None
        values = [s.value for family in text_string_to_metric_families(text)
                  for s in family.samples if s.name == name]
        return sum(values) if values else None

    def counts(self) -> dict[str, float]:
        """What shows a fault hit: the router's stream migrations and prefill fallbacks,
        and the decode workers' failed KV pulls (left out when a decode does not answer)."""
        out = {key: self.metric(name) or 0.0 for key, name in COUNTS.items()}
        loads = [self.load(d) for d in DECODES]
        if all(load is not None for load in loads):
            out["kv_pulls_failed"] = float(sum(load.kv_transfers_failed
                                               for load in loads if load is not None))
        return out

    def load(self, worker_id: str, timeout_s: float = 5.0) -> WorkerLoadReport | None:
        """The worker's ``GetLoad`` (None: no answer). A prober that timed out was closed
        (its answer would come to the next question): a fresh one replaces it."""
        if self.prober is None or not self.prober.alive:
            self.prober = self.net.prober("client")
        try:
            return self.prober.load(f"{self.net.address(worker_id)}:{GRPC_PORT}", timeout_s)
        except RuntimeError:
            return None

    def idle(self, worker_id: str) -> bool:
        """Nothing in flight or running, and no KV lease held (False: no answer)."""
        load = self.load(worker_id)
        return load is not None and (
            load.num_inflight_reqs, load.num_running_reqs, load.kv_leases_held) == (0, 0, 0)

    def whole(self) -> bool:
        registered = {k.rsplit("/", 1)[-1] for k in gateway_keys(self.etcd.url, PREFIX,
                                                                 self.http)}
        return (set(WORKERS) <= registered and set(WORKERS) <= self.healthy()
                and self.metric("pdserve:membership_etcd_up") == 1
                and all(self.idle(w) for w in WORKERS))

    def stream(self, body: dict[str, Any], on_token: Callable[[int], None]) -> Stream:
        """``body`` streamed with its deadline (``X-Request-Timeout``)."""
        ids: list[int] = []
        error = ""
        started = time.monotonic()
        timeout = self.config.request_timeout_s
        try:
            with httpx.stream("POST", self.url + "/v1/completions", json=body,
                              headers={"X-Request-Timeout": str(timeout)},
                              timeout=timeout + 30) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {resp.read()[:300]!r}"
                for event in sse_events(resp.iter_lines() if not error else ()):
                    if "error" in event:
                        error = json.dumps(event["error"])[:300]
                        continue
                    ids += token_ids(event)
                    on_token(len(ids))
        except httpx.HTTPError as exc:
            error = repr(exc)
        return Stream(ids, error, time.monotonic() - started)

    def streams(self, body: dict[str, Any], act: Callable[[], None], after_tokens: int
                ) -> list[Stream]:
        """``config.streams`` streams of ``body`` at once; ``act()`` once, on a thread
        of its own, when the first has ``after_tokens`` tokens (0: once they are sent).
        Returns when every stream ended and ``act`` returned."""
        fired = threading.Lock()
        acting: list[threading.Thread] = []

        def fire() -> None:
            if fired.acquire(blocking=False):
                acting.append(threading.Thread(target=act))
                acting[-1].start()

        def on_token(count: int) -> None:
            if after_tokens and count >= after_tokens:
                fire()

        with ThreadPoolExecutor(self.config.streams) as pool:
            futures = [pool.submit(self.stream, body, on_token)
                       for _ in range(self.config.streams)]
            if not after_tokens:
                time.sleep(0.1)
                fire()
            out = [f.result(timeout=self.config.request_timeout_s + 60) for f in futures]
        fire()  # the streams ended before the fault's token: it still happens
        for thread in acting:
            thread.join(timeout=self.config.request_timeout_s)
        return out

    def signal(self, worker_id: str, sig: int) -> None:
        process.signal_group(self.procs[worker_id].pid, sig)

    def stop(self) -> None:
        for proc in self.procs.values():  # a frozen worker would not see SIGTERM
            process.signal_group(proc.pid, signal.SIGCONT)
        process.stop(list(self.procs.values()), grace_s=10, sig=signal.SIGTERM)
        if self.prober is not None:
            self.prober.close()
        self.etcd.stop()
        self.http.close()
