"""The membership module's cluster (``test_membership_etcd.py``): etcd, a router
(``--placement round_robin --disagg always``), two prefill and two decode workers (real
vLLM, float32, ``--etcd-ttl-s 3``, ``--kv-stall-s 2``, ``--lease-s 10``), each on a host of
its own (``hosted.py``), or on loopback where this machine cannot make hosts; and what the
tests do with it: streams (one, or several at once with a fault at a token), signals,
role switches, cuts and heals (``Cluster.net``), the router's view and each worker's
``GetLoad`` (a prober on the client host), and ``whole``: the bound on a cluster made
whole after a heal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.hosted import LINK_GBIT, Hosted, Prober, hosted
from integration.pd_cases import LONG, MODEL
from pdserve_testing import (
    HTTP,
    etcd_keys,
    exited,
    router_metric,
    sse_events,
    token_ids,
    wait_until,
)

from pdserve.bench.hosts import HostNet, unavailable
from pdserve.core import process
from pdserve.core.ports import free_port
from pdserve.core.types import WorkerLoadReport
from pdserve.membership.local_etcd import LocalEtcd

TTL_S = 3
CLUSTER = "itest"
PREFIX = f"/pdserve/{CLUSTER}/workers/"
ENGINE_START_S = 600
WORKERS = {"prefill-0": ("prefill", "float32"), "prefill-1": ("prefill", "float32"),
           "decode-0": ("decode", "float32"), "decode-1": ("decode", "float32")}
LATE = "decode-bf16"  # started during the etcd outage; its hash differs (dtype)
# The migration tests' long greedy stream, and when (tokens received) the fault hits.
MIGRATION_TOKENS = 64
KILL_AFTER_TOKENS = 16
# The drained worker's --drain-timeout-s: far beyond its stream on any machine, so the
# test sees a drain, never the grace running out (then the stream migrates instead).
DRAIN_GRACE_S = 600
# PDSERVE_DRAIN_REPEAT=N runs the drain test N times, each on a fresh bf16 worker.
DRAIN_REPEAT = int(os.environ.get("PDSERVE_DRAIN_REPEAT", "1"))
# A short stream's first token, on a loaded machine.
STREAM_S = 120.0
_SIGKILL = signal.SIGKILL  # (in Cluster, `signal` is its method)
PREFILLS, DECODES = ("prefill-0", "prefill-1"), ("decode-0", "decode-1")
# The partitions: streams at once, each one's deadline (X-Request-Timeout), the workers'
# --kv-stall-s (a pull that moves no byte for this long fails: decode recomputes) and
# --lease-s (a prefill's KV that no decode can release lapses then), and the prefill
# links' rate while a cut hits the KV pulls (a long prompt's KV then takes seconds).
STREAMS = 3
DEADLINE_S = 120.0
KV_STALL_S = 2.0
LEASE_S = 10.0
PULL_LINK_GBIT = 0.05
# After healing: every worker back in the view, registered, idle and holding no lease
# (a lease no decode could release lapses after LEASE_S).
WHOLE_S = LEASE_S + TTL_S + 20.0
# Registered -> placeable: the watch event, then the router's first probe (up to its 2 s
# timeout; engines loading beside it can make it miss) and one more health interval
# (2 s), plus 1 s. Far below a re-list's time: the router re-lists only on reconnect.
ROUTABLE_S = 5.0
# Slack on lease expiry and re-registration: etcd's expiry scan, an fsync'ed write, the
# watch and the router's view, on a loaded machine.
ETCD_SLACK_S = 5.0
MIGRATION_BODY = {"model": MODEL, "prompt": "Recount every fact, one per line.\n" + LONG,
                  "max_tokens": MIGRATION_TOKENS, "temperature": 0, "ignore_eos": True,
                  "stream": True, "return_token_ids": True,
                  "stream_options": {"include_usage": True}}
# The partitions' streams: shorter (their cut comes at the 16th token, or before).
PARTITION_TOKENS = 32
PARTITION_BODY = {**MIGRATION_BODY, "max_tokens": PARTITION_TOKENS}
# Short: the bf16 worker drained is slow on CPUs without native bf16.
DRAIN_BODY = {**MIGRATION_BODY, "prompt": "Count from one to fifty:", "max_tokens": 24}


@dataclass
class Answer:
    ids: list[int]
    usage: dict[str, Any]
    seconds: float


@dataclass
class Timeline:
    """When each worker id was first/last seen registered in etcd and healthy in the
    router's view, polled every 50 ms from a thread."""

    etcd_url: str
    router_url: str
    registered: dict[str, list[float]] = field(default_factory=dict)  # id -> times seen
    routable: dict[str, list[float]] = field(default_factory=dict)
    listed: dict[str, list[float]] = field(default_factory=dict)  # in the view, any health
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        # This thread's own client (as HTTP: one per poll would cost a core, 40 a second).
        with httpx.Client(limits=httpx.Limits(max_keepalive_connections=0)) as http:
            while not self.stop.wait(0.05):
                now = time.monotonic()
                for key in etcd_keys(self.etcd_url, PREFIX, http):
                    self.registered.setdefault(key.rsplit("/", 1)[-1], []).append(now)
                for w in router_view(self.router_url, http):
                    self.listed.setdefault(str(w["id"]), []).append(now)
                    if w["healthy"]:
                        self.routable.setdefault(str(w["id"]), []).append(now)

    def first(self, table: dict[str, list[float]], worker_id: str, after: float = 0.0) -> float:
        """The first sighting at or after ``after`` (waits up to 5 s for the poller)."""
        seen = wait_until(lambda: [t for t in table.get(worker_id, []) if t >= after], 5.0,
                          interval_s=0.05)
        assert seen, f"{worker_id} never seen after {after}"
        return min(seen)


def router_view(router_url: str, client: httpx.Client = HTTP) -> list[dict[str, object]]:
    try:
        return list(client.get(router_url + "/workers", timeout=2).json()["workers"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


@dataclass
class Outcome:
    """One stream of ``Cluster.streams``: what reached the client, the error event or
    status that ended it (empty if none) and how long it took."""

    ids: list[int]
    usage: dict[str, Any]
    error: str
    seconds: float


@dataclass
class Cluster:
    hosts: Hosted
    etcd: LocalEtcd
    router_url: str
    log_dir: Path
    procs: dict[str, subprocess.Popen[bytes]]
    endpoints: dict[str, str]
    timeline: Timeline
    prober: Prober
    env: dict[str, str]
    admin_url: str = ""  # the router's admin listener, on its host's loopback
    survivor: str = "decode-0"  # the decode worker left after the SIGKILL test
    heal_times: dict[str, float] = field(default_factory=dict)
    _reference: Answer | None = None
    _partition_reference: Answer | None = None

    def spawn(self, name: str, args: list[str]) -> None:
        self.procs[name] = self.hosts.spawn(
            name, [sys.executable, "-m", "pdserve.cli.main", *args],
            self.log_dir / f"{name}.log", self.env)

    def start_worker(self, worker_id: str, role: str, dtype: str, *flags: str) -> None:
        address, port = self.hosts.add(worker_id), free_port()
        self.endpoints[worker_id] = f"{address}:{port}"
        self.spawn(worker_id, [
            role, "--etcd", self.etcd.url, "--cluster", CLUSTER, "--etcd-ttl-s", str(TTL_S),
            "--host", address, "--dtype", dtype, "--kv-cache-gib", "1", "--port", str(port),
            "--kv-port", str(free_port()), "--worker-id", worker_id, "--kv-stall-s",
            str(KV_STALL_S), "--lease-s", str(LEASE_S), *flags])

    def view(self) -> dict[str, dict[str, object]]:
        return {str(w["id"]): w for w in router_view(self.router_url)}

    def healthy(self) -> set[str]:
        return {i for i, w in self.view().items() if w["healthy"]}

    def load(self, worker_id: str) -> WorkerLoadReport:
        return self.prober.load(self.endpoints[worker_id])

    def complete(self, i: int) -> str:
        body = {"model": "SmolLM2-135M-Instruct", "prompt": f"Request {i}: count to five.",
                "max_tokens": 4, "temperature": 0}
        r = HTTP.post(self.router_url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return str(r.json()["choices"][0]["text"])

    def metric(self, name: str, *labels: str) -> float:
        return router_metric(self.router_url, name, *labels)

    def signal(self, worker_id: str, sig: int) -> None:
        os.killpg(self.procs[worker_id].pid, sig)

    def switch_role(self, worker_id: str, role: str, drain_timeout_s: float = 30.0
                    ) -> dict[str, Any]:
        """``POST /admin/workers/{id}/role`` on the router's admin listener."""
        r = self.hosts.call(lambda: httpx.post(
            f"{self.admin_url}/admin/workers/{worker_id}/role",
            json={"role": role, "drain_timeout_s": drain_timeout_s}, timeout=120),
            where="router")
        assert r.status_code == 200, r.text
        return dict(r.json())

    def idle(self, worker_id: str) -> bool:
        """Nothing in flight, running or held in the KV cache."""
        load = self.load(worker_id)
        return (load.num_inflight_reqs, load.num_running_reqs, load.kv_cache_usage) == (0, 0, 0)

    def reference_answer(self) -> Answer:
        """The migration stream, uninterrupted (computed once)."""
        if self._reference is None:
            started = time.monotonic()
            ids, usage, _ = self.stream()
            assert len(ids) == MIGRATION_TOKENS == usage["completion_tokens"]
            self._reference = Answer(ids, usage, time.monotonic() - started)
        return self._reference

    def partition_reference(self) -> Answer:
        """The partitions' stream, uninterrupted (computed once)."""
        if self._partition_reference is None:
            started = time.monotonic()
            ids, usage, _ = self.stream(body=PARTITION_BODY)
            assert len(ids) == PARTITION_TOKENS == usage["completion_tokens"]
            self._partition_reference = Answer(ids, usage, time.monotonic() - started)
        return self._partition_reference

    def stream(self, act_after: int | None = None, sig: int = _SIGKILL,
               body: dict[str, Any] = MIGRATION_BODY,
               act: Callable[[str], None] | None = None
               ) -> tuple[list[int], dict[str, Any], str]:
        """The migration stream's (or ``body``'s) token ids and usage; after
        ``act_after`` tokens have reached the client, ``sig`` goes to the decode worker
        serving it (its id is returned), or ``act(its id)`` runs in a thread beside
        the stream (joined before this returns)."""
        acting: list[threading.Thread] = []
        ids: list[int] = []
        usage: dict[str, Any] = {}
        serving = hit = ""
        with httpx.stream("POST", self.router_url + "/v1/completions", json=body,
                          timeout=300) as resp:
            assert resp.status_code == 200, resp.read()
            for event in sse_events(resp.iter_lines()):
                assert "error" not in event, event
                usage = event.get("usage") or usage
                ids += token_ids(event)
                if act_after is not None and ids and not serving:
                    # Found at the first token, so the signal at act_after is not late
                    # on a machine that streams the rest in a blink.
                    (serving,) = [w for w in ("decode-0", "decode-1")
                                  if self.load(w).num_inflight_reqs]
                if serving and not hit and len(ids) >= (act_after or 0):
                    hit = serving
                    if act is None:
                        self.signal(hit, sig)
                    else:
                        acting.append(threading.Thread(target=act, args=(hit,)))
                        acting[-1].start()
        for thread in acting:
            thread.join(timeout=300)
        return ids, usage, hit


    @property
    def net(self) -> HostNet:
        """The hosts' network; the test skips (with the reason) where there is none."""
        if self.hosts.net is None:
            pytest.skip(f"a partition needs hosts: {unavailable()}")
        return self.hosts.net

    def one_stream(self, body: dict[str, Any], on_token: Callable[[int], None]) -> Outcome:
        """``body`` streamed with a deadline of DEADLINE_S; ``on_token(tokens so far)``."""
        ids: list[int] = []
        usage: dict[str, Any] = {}
        error = ""
        started = time.monotonic()
        try:
            with httpx.stream("POST", self.router_url + "/v1/completions", json=body,
                              headers={"X-Request-Timeout": str(DEADLINE_S)},
                              timeout=DEADLINE_S + 30) as resp:
                if resp.status_code != 200:
                    error = f"HTTP {resp.status_code}: {resp.read()[:500]!r}"
                for event in sse_events(resp.iter_lines() if not error else ()):
                    if "error" in event:
                        error = json.dumps(event["error"])
                        continue
                    usage = event.get("usage") or usage
                    ids += token_ids(event)
                    on_token(len(ids))
        except httpx.HTTPError as exc:
            error = repr(exc)
        return Outcome(ids, usage, error, time.monotonic() - started)

    def streams(self, act: Callable[[], None] | None = None, after_tokens: int = 0,
                n: int = STREAMS, body: dict[str, Any] = PARTITION_BODY) -> list[Outcome]:
        """``n`` streams at once. ``act()`` runs once, on a thread of its own: as soon as
        the streams are sent (``after_tokens`` 0) or when the first has ``after_tokens``
        tokens. Returns once every stream has ended and ``act`` has returned."""
        fired = threading.Lock()
        acting: list[threading.Thread] = []

        def fire() -> None:
            if act is not None and fired.acquire(blocking=False):
                acting.append(threading.Thread(target=act))
                acting[-1].start()

        def on_token(count: int) -> None:
            if after_tokens and count >= after_tokens:
                fire()

        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(self.one_stream, body, on_token) for _ in range(n)]
            if not after_tokens:
                time.sleep(0.1)  # the requests are on their way
                fire()
            outcomes = [f.result(timeout=DEADLINE_S + 60) for f in futures]
        for thread in acting:
            thread.join(timeout=60)
        assert acting, "the streams ended before the fault"
        return outcomes

    def heal(self) -> float:
        """Every cut undone (and every link back at its rate): when."""
        self.net.heal()
        for name, host in self.net.hosts.items():
            if host.rate_gbit != LINK_GBIT:
                self.net.shape(name, LINK_GBIT)
        return time.monotonic()

    def whole(self, fault: str, healed: float, workers: tuple[str, ...] = tuple(WORKERS)
              ) -> None:
        """Within WHOLE_S of ``healed``: each of ``workers`` registered in etcd, healthy
        in the router's view and holding no request, block or lease. Records the time."""
        def done() -> bool:
            keys = {k.rsplit("/", 1)[-1] for k in etcd_keys(self.etcd.url, PREFIX)}
            if not (set(workers) <= keys and set(workers) <= self.healthy()):
                return False
            try:
                return all(self.idle(w) and not self.load(w).kv_leases_held for w in workers)
            except RuntimeError:  # a probe that failed: not yet
                return False

        assert wait_until(done, WHOLE_S, 0.2), (
            f"not whole {WHOLE_S} s after healing {fault}: view {self.view()}, "
            f"{exited(self.procs, self.log_dir)}")
        self.heal_times[fault] = round(time.monotonic() - healed, 2)


def answers(outcomes: list[Outcome], want: Answer) -> None:
    """Every stream ended within its deadline with the uninterrupted answer."""
    for o in outcomes:
        assert not o.error, o.error
        assert o.ids == want.ids, "an answer differs from the uninterrupted one"
        assert o.usage["completion_tokens"] == len(want.ids)
        assert o.usage["prompt_tokens"] == want.usage["prompt_tokens"]
        assert o.seconds < DEADLINE_S


def kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every group (a SIGSTOPped one too) and what they started; reaped."""
    for proc in procs:
        process.signal_group(proc.pid, signal.SIGCONT)
    process.stop(procs, grace_s=0, sig=signal.SIGKILL)


@contextmanager
def running_cluster(model_path: Path, log_dir: Path) -> Iterator[Cluster]:
    """The cluster, started; the calling thread on the client host until it ends (its
    HTTP calls, and the threads it starts, reach the hosts' addresses from there)."""
    env = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "PDSERVE_CACHE": os.environ.get("PDSERVE_CACHE", str(model_path.parents[1]))}
    with hosted() as hosts, hosts.client():  # the hosts, and what runs there, go last
        etcd = hosts.etcd(log_dir)
        router, port, admin_port = hosts.add("router"), free_port(), free_port()
        router_url = f"http://{router}:{port}"
        timeline = Timeline(etcd.url, router_url)
        c = Cluster(hosts, etcd, router_url, log_dir, {}, {}, timeline, hosts.prober(), env,
                    admin_url=f"http://127.0.0.1:{admin_port}")
        observer = threading.Thread(target=timeline.run, daemon=True)
        try:
            # round_robin: these tests count which worker served; cache_aware would send
            # nothing to a decode worker no prefill can pair with. --disagg always: their
            # short prompts would otherwise skip prefill.
            c.spawn("router", ["router", "--etcd", etcd.url, "--cluster", CLUSTER, "--host",
                               router, "--port", str(port), "--placement", "round_robin",
                               "--disagg", "always", "--admin-port", str(admin_port)])
            observer.start()
            for worker_id, (role, dtype) in WORKERS.items():  # engines load in parallel
                c.start_worker(worker_id, role, dtype)
            _wait_started(c)
            yield c
        finally:
            timeline.stop.set()
            kill_all(list(c.procs.values()))
            etcd.stop()
            c.prober.close()
            if observer.is_alive():
                observer.join(timeout=5)
            (log_dir / "heal-times.json").write_text(json.dumps(c.heal_times, indent=1))


def _wait_started(c: Cluster) -> None:
    """Until every worker of ``WORKERS`` is healthy in the router's view. A worker that
    exits while the four engines load is started once more, as its supervisor
    (Kubernetes, ``pdserve up``) would, with a warning that carries its log: one CI run
    lost the module to a worker that exited 1 there and nowhere else."""
    restarted: set[str] = set()
    while True:
        ready = wait_until(lambda: c.healthy() >= set(WORKERS) or exited(c.procs, c.log_dir),
                           ENGINE_START_S, interval_s=1.0)
        if ready is True:
            return
        dead = {n for n, p in c.procs.items() if p.poll() is not None}
        assert dead and dead <= set(WORKERS) - restarted, (
            f"cluster not ready: {ready or c.view()} (logs {c.log_dir})")
        warnings.warn(f"restarting what exited while starting: {ready}", stacklevel=1)
        for worker_id in dead:
            log = c.log_dir / f"{worker_id}.log"
            log.rename(log.with_suffix(".first.log"))
            c.start_worker(worker_id, *WORKERS[worker_id])
            restarted.add(worker_id)
