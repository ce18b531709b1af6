"""Membership on a real etcd with real vLLM workers (``pdserve prefill|decode --etcd``)
and a real router (``pdserve router --etcd``), one cluster shared by the module, each
process on a host of its own (``hosted.py``: network namespaces, links at 10 Gbit/s; the
test's thread on a client host), or on loopback where this machine cannot make hosts
(then the partitions skip, with the reason).

The tests run in file order on that cluster: discovery within 2 s, spread over
2 prefill + 2 decode, the decode worker serving a long greedy stream SIGSTOPped
(keepalive notices, the stream moves to the other decode worker, the answer is
unchanged) then SIGKILLed (the same, and it leaves the view within its TTL), SIGSTOP
of a prefill worker past the TTL then SIGCONT, an etcd outage and restart (a worker
started during it is discovered: a bfloat16 decode worker, incompatible with the
float32 prefill workers), and the incompatible worker never paired (it serves alone,
computing prompts itself), then SIGTERM to that worker mid-stream (it drains). At
most four engines run at once. Workers use a 3 s lease
TTL (``--etcd-ttl-s 3``; the default is 10 s).

The partitions (issue 43's part 3), each under a few concurrent streams, between the
SIGSTOP and the SIGKILL tests: the router cut from a decode worker mid-stream, prefill
cut from decode during the KV pulls, an asymmetric cut (prefill's packets to the router
dropped, the router's to prefill not), a worker cut from etcd, the router cut from etcd.
The SIGSTOP test is the frozen peer. Each: every stream ends within its deadline with the
uninterrupted answer, and within a bound after healing the cluster is whole (every worker
registered and healthy in the router's view, none holding a request, a block or a
lease); the time that took is written to ``heal-times.json`` in the module's log folder.
"""

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.hosted import LINK_GBIT, Hosted, Prober, hosted
from integration.pd_cases import LONG, MODEL
from pdserve_testing import HTTP, etcd_keys, exited, router_metric, wait_until

from pdserve.bench.hosts import HostNet, unavailable
from pdserve.core import process
from pdserve.core.ports import free_port
from pdserve.core.types import WorkerLoadReport
from pdserve.membership.local_etcd import LocalEtcd

pytestmark = pytest.mark.integration
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
            for line in resp.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line.removeprefix("data: "))
                assert "error" not in event, event
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    ids += choice.get("token_ids") or []
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
                for line in resp.iter_lines() if not error else ():
                    if not line.startswith("data: {"):
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        error = json.dumps(event["error"])
                        continue
                    usage = event.get("usage") or usage
                    ids += [t for c in event["choices"] for t in c.get("token_ids") or []]
                    on_token(len(ids))
        except httpx.HTTPError as exc:
            error = repr(exc)
        return Outcome(ids, usage, error, time.monotonic() - started)

    def streams(self, act: Callable[[], None] | None = None, after_tokens: int = 0,
                n: int = STREAMS, body: dict[str, Any] = MIGRATION_BODY) -> list[Outcome]:
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


def _answers(outcomes: list[Outcome], want: Answer) -> None:
    """Every stream ended within its deadline with the uninterrupted answer."""
    for o in outcomes:
        assert not o.error, o.error
        assert o.ids == want.ids, "an answer differs from the uninterrupted one"
        assert o.usage["completion_tokens"] == MIGRATION_TOKENS
        assert o.usage["prompt_tokens"] == want.usage["prompt_tokens"]
        assert o.seconds < DEADLINE_S


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL every group (a SIGSTOPped one too) and what they started; reaped."""
    for proc in procs:
        process.signal_group(proc.pid, signal.SIGCONT)
    process.stop(procs, grace_s=0, sig=signal.SIGKILL)


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The module's cluster. This thread is on the client host for the whole module (its
    HTTP calls, and the threads it starts, reach the hosts' addresses from there)."""
    log_dir = tmp_path_factory.mktemp("etcd-cluster")
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
            _kill(list(c.procs.values()))
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


def test_registered_workers_are_routable_at_once(cluster: Cluster) -> None:
    t = cluster.timeline
    for worker_id in WORKERS:
        registered = t.first(t.registered, worker_id)
        assert t.first(t.routable, worker_id, registered) - registered <= ROUTABLE_S, worker_id
    keys = etcd_keys(cluster.etcd.url, PREFIX)
    info = json.loads(keys[PREFIX + "decode/decode-0"])
    assert info["grpc_endpoint"] == cluster.endpoints["decode-0"]
    assert info["dtype"] == "float32" and info["block_size"] > 0 and info["compatibility_hash"]
    assert set(info["kv_endpoints"]) == {"tcp"} and info["capacity"]["num_kv_blocks"] > 0


def test_requests_spread_over_two_prefill_and_two_decode(cluster: Cluster) -> None:
    before = {w: cluster.load(w) for w in WORKERS}
    for i in range(6):
        cluster.complete(i)
    after = {w: cluster.load(w) for w in WORKERS}
    for worker_id in ("prefill-0", "prefill-1"):
        assert (after[worker_id].prompt_tokens_computed
                > before[worker_id].prompt_tokens_computed), worker_id
    for worker_id in ("decode-0", "decode-1"):  # KV from P
        assert (after[worker_id].prompt_tokens_external
                > before[worker_id].prompt_tokens_external), worker_id


def test_decode_switches_role_mid_stream_the_stream_is_uncut_then_it_serves_prefill(
        cluster: Cluster) -> None:
    """``POST /admin/workers/{id}/role`` on the decode worker serving a greedy stream,
    with no drain time: its stream is aborted there and continues on the other decode
    worker (migration), the client's text is the uninterrupted one (which equals one
    aggregated engine's: tests/integration/test_pd_e2e.py), the same process and engine
    then serves prefill (its key moved in etcd), and no worker holds a block. It is
    switched back to decode after (drained), for the tests after this one."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    switched: list[dict[str, Any]] = []
    got, usage, serving = cluster.stream(
        act_after=KILL_AFTER_TOKENS,
        act=lambda w: switched.append(cluster.switch_role(w, "prefill", drain_timeout_s=0)))
    assert serving and switched, "the stream ended before the switch"
    (result,) = switched
    assert got == want.ids, "the answer through the switch differs from the uninterrupted one"
    assert usage["completion_tokens"] == MIGRATION_TOKENS
    assert (result["role"], result["previous_role"], result["changed"]) == (
        "prefill", "decode", True)
    # Cut there after 16 of 64 tokens (no drain time), continued on the other decode.
    assert result["num_aborted"] == 1
    assert cluster.metric("pdserve:migrations_total", 'reason="') == before + 1
    other = "decode-1" if serving == "decode-0" else "decode-0"
    pid = cluster.procs[serving].pid
    loaded = cluster.load(other).prompt_tokens_external
    try:
        keys = etcd_keys(cluster.etcd.url, PREFIX)
        assert PREFIX + f"prefill/{serving}" in keys and PREFIX + f"decode/{serving}" not in keys
        assert wait_until(lambda: cluster.view().get(serving, {}).get("role") == "prefill"
                          and cluster.view()[serving]["healthy"], ROUTABLE_S)
        computed = cluster.load(serving).prompt_tokens_computed
        for i in range(6):  # round robin over three prefill workers now
            cluster.complete(100 + i)
        assert cluster.load(serving).prompt_tokens_computed > computed, "it never prefilled"
        assert cluster.load(other).prompt_tokens_external > loaded  # KV from P, as before
        assert cluster.procs[serving].poll() is None and cluster.procs[serving].pid == pid
    finally:
        back = cluster.switch_role(serving, "decode")
        assert back["role"] == "decode" and back["num_aborted"] == 0
        assert wait_until(lambda: {w for w, v in cluster.view().items() if v["healthy"]
                                   and v["role"] == "decode"} >= {"decode-0", "decode-1"},
                          ROUTABLE_S + ETCD_SLACK_S)
    # Nothing leaked: no request in flight or running, no block held, no lease left.
    assert wait_until(lambda: all(cluster.idle(w) and not cluster.load(w).kv_leases_held
                                  for w in WORKERS), 30.0)


def test_decode_paused_mid_stream_the_stream_moves_and_the_answer_is_unchanged(
        cluster: Cluster) -> None:
    """The frozen peer: SIGSTOP of decode-0 (a hung worker, not a dead one) while
    STREAMS greedy streams run, at the first one's 16th token (round robin gave it at
    least one). gRPC keepalive notices within seconds, not at the request's deadline,
    and the router continues each of its streams on the other decode worker from prompt +
    the tokens sent; the other streams go on. Resumed, it re-registers, drops the
    abandoned requests and serves again."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    try:
        outcomes = cluster.streams(lambda: cluster.signal("decode-0", signal.SIGSTOP),
                                   after_tokens=KILL_AFTER_TOKENS)
        _answers(outcomes, want)
        assert max(o.seconds for o in outcomes) < want.seconds * STREAMS + 30  # not 600 s
        assert cluster.metric("pdserve:migrations_total", 'reason="') >= before + 1
    finally:
        cluster.signal("decode-0", signal.SIGCONT)
    assert wait_until(lambda: "decode-0" in cluster.healthy(), TTL_S + 10, 0.1)
    assert wait_until(lambda: cluster.idle("decode-0"), 30.0, 0.5), "decode-0 holds KV"


def test_router_cut_from_a_decode_worker_mid_stream_its_streams_move(cluster: Cluster) -> None:
    """The router and decode-0 partitioned (both ways, packets dropped silently) at the
    first stream's 16th token: keepalive notices, decode-0's streams continue on decode-1,
    every answer is the uninterrupted one; healed, decode-0 is back and idle."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    try:
        outcomes = cluster.streams(lambda: cluster.net.cut("router", "decode-0", both=True),
                                   after_tokens=KILL_AFTER_TOKENS)
    finally:
        healed = cluster.heal()
    _answers(outcomes, want)
    assert cluster.metric("pdserve:migrations_total", 'reason="') >= before + 1
    cluster.whole("router | decode-0, mid-stream", healed)


def test_prefill_cut_from_decode_during_the_kv_pulls_decode_recomputes(
        cluster: Cluster) -> None:
    """Each prefill's link at PULL_LINK_GBIT (a long prompt's KV takes seconds), then
    every prefill and decode partitioned at the first token (when the first pull has
    begun): each pull stalls, fails after --kv-stall-s, and decode recomputes the prompt
    (vLLM's recompute policy); every answer is the uninterrupted one. Healed, the
    prefills' leases that no decode could release lapse (--lease-s)."""
    net, want = cluster.net, cluster.reference_answer()
    failed = sum(cluster.load(d).kv_transfers_failed for d in DECODES)

    def cut() -> None:
        for p in PREFILLS:
            for d in DECODES:
                net.cut(p, d, both=True)

    for p in PREFILLS:
        net.shape(p, PULL_LINK_GBIT)
    try:
        outcomes = cluster.streams(cut, after_tokens=1)
    finally:
        healed = cluster.heal()
    _answers(outcomes, want)
    assert sum(cluster.load(d).kv_transfers_failed for d in DECODES) > failed
    cluster.whole("prefill | decode, during the KV pulls", healed)


def test_prefill_cut_from_the_router_one_way_decode_computes_the_prompts(
        cluster: Cluster) -> None:
    """Asymmetric: the router reaches the prefill workers, their packets to it are
    dropped, from just after the streams are sent. The router's calls get no answer,
    keepalive gives up, and decode computes the prompts itself (a prefill fallback);
    every answer is the uninterrupted one."""
    net, want = cluster.net, cluster.reference_answer()
    fallbacks = cluster.metric("pdserve:prefill_fallbacks_total")

    def cut() -> None:
        for p in PREFILLS:
            net.cut(p, "router")

    try:
        outcomes = cluster.streams(cut)
    finally:
        healed = cluster.heal()
    _answers(outcomes, want)
    assert cluster.metric("pdserve:prefill_fallbacks_total") >= fallbacks + 1
    cluster.whole("prefill -> router (one way)", healed)


def test_a_worker_cut_from_etcd_leaves_the_view_and_rejoins_when_healed(
        cluster: Cluster) -> None:
    """prefill-1 and etcd partitioned: its lease lapses within the TTL and it leaves the
    router's view while the streams are served by the others; healed, it registers
    again, is routable and serves."""
    net, want = cluster.net, cluster.reference_answer()
    net.cut("prefill-1", "etcd", both=True)
    cut = time.monotonic()
    try:
        outcomes = cluster.streams(lambda: None)
        assert wait_until(lambda: "prefill-1" not in cluster.view(), TTL_S + ETCD_SLACK_S, 0.1)
        assert time.monotonic() - cut <= TTL_S + ETCD_SLACK_S
    finally:
        healed = cluster.heal()
    _answers(outcomes, want)
    cluster.whole("prefill-1 | etcd", healed)
    computed = cluster.load("prefill-1").prompt_tokens_computed
    for j in range(4):
        cluster.complete(700 + j)
    assert cluster.load("prefill-1").prompt_tokens_computed > computed


def test_the_router_cut_from_etcd_serves_on_its_last_view(cluster: Cluster) -> None:
    """The router and etcd partitioned past the workers' TTL: it says etcd is down,
    keeps every worker it knew, and serves the streams; healed, it is back on etcd."""
    net, want = cluster.net, cluster.reference_answer()
    before = cluster.healthy()
    net.cut("router", "etcd", both=True)
    ends = time.monotonic() + TTL_S + 1
    try:
        outcomes = cluster.streams(lambda: None)
        assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 0,
                          TTL_S + ETCD_SLACK_S)
        time.sleep(max(0.0, ends - time.monotonic()))
        assert cluster.healthy() == before
    finally:
        healed = cluster.heal()
    _answers(outcomes, want)
    assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 1, WHOLE_S)
    cluster.whole("router | etcd", healed)


def test_decode_killed_mid_stream_the_answer_is_unchanged_and_it_leaves_the_view(
        cluster: Cluster) -> None:
    """SIGKILL of the decode worker serving a long greedy stream: the client's answer is
    the uninterrupted one, token for token; the worker leaves the view within its TTL;
    requests keep succeeding; no KV is left held on the survivor."""
    want = cluster.reference_answer()
    before = cluster.metric("pdserve:migrations_total", 'reason="')
    got, usage, killed = cluster.stream(act_after=KILL_AFTER_TOKENS, sig=signal.SIGKILL)
    killed_at = time.monotonic()
    assert killed, "the stream ended before the kill"
    assert got == want.ids, "the migrated answer differs from the uninterrupted one"
    assert usage["completion_tokens"] == MIGRATION_TOKENS  # every token counted once
    assert usage["prompt_tokens"] == want.usage["prompt_tokens"]
    assert cluster.metric("pdserve:migrations_total", 'reason="') == before + 1
    cluster.procs[killed].wait(timeout=30)
    cluster.survivor = "decode-1" if killed == "decode-0" else "decode-0"
    i = 100
    while killed in cluster.view() and time.monotonic() - killed_at < TTL_S + 5:
        cluster.complete(i)  # asserts success: served by the others meanwhile
        i += 1
    assert wait_until(lambda: killed not in cluster.view(), 1.0, interval_s=0.05)
    t = cluster.timeline
    assert max(t.listed[killed]) - killed_at <= TTL_S + ETCD_SLACK_S  # last seen in the view
    assert killed not in etcd_keys(cluster.etcd.url, PREFIX + "decode/")
    for j in range(3):
        cluster.complete(200 + j)
    assert wait_until(lambda: cluster.idle(cluster.survivor), 15.0, 0.5)


def test_paused_worker_reregisters_and_serves_again(cluster: Cluster) -> None:
    cluster.signal("prefill-1", signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        assert wait_until(lambda: "prefill-1" not in cluster.view(), TTL_S + 5, 0.1)
        assert time.monotonic() - stopped <= TTL_S + ETCD_SLACK_S
        time.sleep(1.0)
    finally:
        cluster.signal("prefill-1", signal.SIGCONT)
    resumed = time.monotonic()
    assert wait_until(lambda: "prefill-1" in cluster.healthy(), TTL_S + 5, 0.1)
    t = cluster.timeline
    assert t.first(t.registered, "prefill-1", resumed) - resumed <= TTL_S / 3 + ETCD_SLACK_S
    computed = cluster.load("prefill-1").prompt_tokens_computed
    for j in range(4):
        cluster.complete(500 + j)
    assert cluster.load("prefill-1").prompt_tokens_computed > computed


def test_etcd_outage_keeps_serving_then_discovers_a_new_worker(cluster: Cluster) -> None:
    before = cluster.healthy()
    reconnects = cluster.metric("pdserve:membership_etcd_reconnects_total")
    cluster.etcd.stop(keep_data=True)  # SIGKILL
    assert wait_until(lambda: cluster.metric("pdserve:membership_etcd_up") == 0, 5.0)
    # Registers once etcd is back; drained by the last test.
    cluster.start_worker(LATE, "decode", "bfloat16", "--drain-timeout-s", str(DRAIN_GRACE_S))
    outage_end = time.monotonic() + TTL_S + 1  # past the TTL: nothing may expire
    i = 300
    while time.monotonic() < outage_end:
        cluster.complete(i)
        i += 1
    assert cluster.healthy() == before
    restarted = time.monotonic()
    cluster.etcd.start()
    assert wait_until(lambda: LATE in cluster.healthy(), ENGINE_START_S, 0.5), (
        f"{LATE} not discovered; see {cluster.log_dir}")
    t = cluster.timeline
    assert t.first(t.registered, LATE) >= restarted
    assert t.first(t.routable, LATE) - t.first(t.registered, LATE) <= ROUTABLE_S
    assert cluster.metric("pdserve:membership_etcd_up") == 1
    assert cluster.metric("pdserve:membership_etcd_reconnects_total") >= reconnects + 1
    assert before <= cluster.healthy()
    for j in range(4):
        cluster.complete(400 + j)
    assert cluster.load(LATE).prompt_tokens_computed > 0  # it serves


def test_incompatible_worker_is_never_paired(cluster: Cluster) -> None:
    view = cluster.view()
    hashes = {i: w["compatibility_hash"] for i, w in view.items()}
    survivor = cluster.survivor
    assert view[LATE]["healthy"] and hashes[LATE] != hashes["prefill-0"] == hashes[survivor]
    no_prefill = ("pdserve:disagg_decisions_total", 'decision="local"', 'reason="no_prefill"')
    local = cluster.metric(*no_prefill)
    computed = cluster.load(LATE).prompt_tokens_computed
    external = cluster.load(survivor).prompt_tokens_external
    for j in range(6):
        cluster.complete(600 + j)
    # Round robin gave the bf16 decode worker half of these; no prefill worker may be
    # paired with it, so it computed those prompts itself (a local decision, reason
    # no_prefill: not a failed prefill) and received no KV.
    late = cluster.load(LATE)
    assert late.prompt_tokens_computed > computed
    assert (late.prompt_tokens_external, late.kv_bytes_received) == (0, 0)
    assert cluster.metric(*no_prefill) >= local + 3
    assert cluster.load(survivor).prompt_tokens_external > external


@pytest.mark.parametrize("attempt", range(DRAIN_REPEAT))
def test_sigterm_drains_a_decode_worker_its_stream_completes_and_it_exits(
        cluster: Cluster, attempt: int) -> None:
    """SIGTERM to a decode worker at its stream's first token (the last test: the worker
    is gone after it): it leaves the view at once (its lease revoked), new requests go to
    the other decode worker, its own stream completes there, not migrated, and it exits.

    Once failed on a CPU whose engines stalled 5 s per lost wake-up: the bf16 stream
    outlasted the default 30 s grace, the worker's server cancelled it (UNAVAILABLE), and
    migration, which then took only a worker of the same compatibility hash, found none.
    """
    drained_id = LATE if attempt == 0 and LATE in cluster.healthy() else f"drain-{attempt}"
    if drained_id != LATE:  # -k drain, or a repeat: a fresh bf16 worker
        cluster.start_worker(drained_id, "decode", "bfloat16", "--drain-timeout-s",
                             str(DRAIN_GRACE_S))
        assert wait_until(lambda: drained_id in cluster.healthy(), ENGINE_START_S, 0.5)
    proc = cluster.procs[drained_id]
    migrations = cluster.metric("pdserve:migrations_total", 'reason="')
    streams: list[list[int]] = []
    errors: list[BaseException] = []
    signalled = threading.Event()

    def one() -> None:
        """A stream; the one on the drained worker (no prefill can pair with it, so its
        route says no_prefill) SIGTERMs it when its first token arrives."""
        try:
            ids: list[int] = []
            with httpx.stream("POST", cluster.router_url + "/v1/completions", json=DRAIN_BODY,
                              timeout=600) as resp:
                assert resp.status_code == 200, resp.read()
                ours = "no_prefill" in resp.headers.get("x-pdserve-disagg", "")
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line.removeprefix("data: "))
                        assert "error" not in event, event
                        ids += [t for c in event["choices"] for t in c.get("token_ids") or []]
                        if ours and ids and not signalled.is_set():
                            proc.send_signal(signal.SIGTERM)  # the worker, not its engine
                            signalled.set()
            streams.append(ids)
        except BaseException as exc:  # noqa: BLE001 - reported by the test below
            errors.append(exc)

    # Round robin: of two requests at once, one lands on each decode worker.
    # One stream per decode worker: round_robin gives each one, the drained one too.
    num_decode = sum(w["healthy"] and w["role"] == "decode" for w in cluster.view().values())
    clients = [threading.Thread(target=one) for _ in range(num_decode)]
    for t in clients:
        t.start()
    assert signalled.wait(STREAM_S), f"no stream reached {drained_id}: {errors}"
    assert wait_until(lambda: drained_id not in cluster.view(), 10.0, 0.05)
    for j in range(2):
        cluster.complete(800 + 10 * attempt + j)  # served by the others meanwhile
    for t in clients:
        t.join(timeout=DRAIN_GRACE_S)
    assert not errors, errors
    assert [len(ids) for ids in streams] == [DRAIN_BODY["max_tokens"]] * num_decode
    assert cluster.metric("pdserve:migrations_total", 'reason="') == migrations  # drained
    assert proc.wait(timeout=60) == 0  # once idle, not at the grace
