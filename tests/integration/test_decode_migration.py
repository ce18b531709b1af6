"""Decode failover mid-stream on real vLLM engines: the decode worker serving a long
greedy stream is SIGKILLed (worker and engine), the router continues the request on the
other decode worker from prompt + the tokens already sent, and the client's answer is
the uninterrupted one, token for token (float32, as the P/D oracle).

Its own cluster, not ``pdserve up``: ``up`` stops every component when one exits, so
each component runs here as its own process (group): one prefill, two decode workers,
one router with ``--disagg always`` (so the KV handoff runs before the kill)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.pd_cases import LONG, MODEL
from pdserve.router.worker_client import probe_load
from pdserve_testing import router_metric, wait_until

from pdserve.up import free_port

pytestmark = pytest.mark.integration

STARTUP_TIMEOUT_S = 600
MAX_TOKENS = 160
KILL_AFTER_TOKENS = 24  # ~1 s of decode on CPU: well inside the stream
BODY = {"model": MODEL, "prompt": "Recount every fact, one per line.\n" + LONG,
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
        "return_token_ids": True, "stream_options": {"include_usage": True}}


@dataclass
class Cluster:
    router_url: str  # http://host:port (no /v1)
    decode: dict[str, subprocess.Popen[bytes]]  # gRPC endpoint -> its worker process
    procs: list[subprocess.Popen[bytes]]

    def workers(self) -> list[dict[str, Any]]:
        return httpx.get(self.router_url + "/workers", timeout=5).json()["workers"]


def _spawn(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """A ``pdserve`` component in its own process group (its engine process included)."""
    with open(log, "wb") as out:
        return subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def cluster(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    logs = tmp_path_factory.mktemp("migration")
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PDSERVE_CACHE=os.environ.get("PDSERVE_CACHE", str(model_path.parents[1])))
    common = ["--model", str(model_path), "--max-model-len", "4096"]
    engine = ["--dtype", "float32", "--kv-cache-gib", "1", "--transport", "tcp",
              "--kv-checksum"]
    procs: list[subprocess.Popen[bytes]] = []
    endpoints: dict[str, list[str]] = {"prefill": [], "decode": []}
    decode: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for role, n in (("prefill", 1), ("decode", 2)):
            for i in range(n):
                port = free_port()
                proc = _spawn([role, *common, *engine, "--port", str(port), "--kv-port",
                               str(free_port()), "--worker-id", f"{role}-{i}"], env,
                              logs / f"{role}-{i}.log")
                procs.append(proc)
                endpoints[role].append(f"127.0.0.1:{port}")
                if role == "decode":
                    decode[f"127.0.0.1:{port}"] = proc
        http_port = free_port()
        procs.append(_spawn(["router", *common, "--port", str(http_port),
                             "--prefill", ",".join(endpoints["prefill"]),
                             "--decode", ",".join(endpoints["decode"]),
                             "--disagg", "always", "--max-migrations", "3"], env,
                            logs / "router.log"))
        c = Cluster(f"http://127.0.0.1:{http_port}", decode, procs)

        def ready() -> bool:
            if any(p.poll() is not None for p in procs):
                raise RuntimeError(f"a component exited during startup; logs in {logs}")
            try:
                return sum(w["healthy"] for w in c.workers()) == 3
            except (httpx.HTTPError, ValueError, KeyError):
                return False

        assert wait_until(ready, timeout_s=STARTUP_TIMEOUT_S, interval_s=1), (
            f"cluster not ready; logs in {logs}")
        yield c
    finally:
        for proc in procs:
            _stop(proc)


def _stream(c: Cluster, kill_after: int | None = None) -> tuple[list[int], dict[str, Any], str]:
    """The completion's token ids, its usage and the endpoint of the decode worker that
    was killed after ``kill_after`` tokens reached the client (if asked)."""
    ids: list[int] = []
    usage: dict[str, Any] = {}
    killed = ""
    with httpx.stream("POST", c.router_url + "/v1/completions", json=BODY,
                      timeout=300) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
            if kill_after is not None and not killed and len(ids) >= kill_after:
                killed = _kill_serving_decode(c)
    return ids, usage, killed


def _kill_serving_decode(c: Cluster) -> str:
    """SIGKILL the decode worker running the request, its engine process with it."""
    (serving,) = [e for e in c.decode if probe_load(e, timeout_s=5).num_inflight_reqs]
    os.killpg(c.decode[serving].pid, signal.SIGKILL)
    return serving


def test_decode_killed_mid_stream_the_answer_is_the_uninterrupted_one(cluster: Cluster) -> None:
    want, want_usage, _ = _stream(cluster)
    assert len(want) == MAX_TOKENS and want_usage["completion_tokens"] == MAX_TOKENS
    before = router_metric(cluster.router_url, "pdserve_dispatch_migrations_total",
                           'reason="')

    got, usage, killed = _stream(cluster, kill_after=KILL_AFTER_TOKENS)

    assert killed, "the stream ended before the kill"
    assert got == want, "the migrated answer differs from the uninterrupted one"
    # Every token counted once; the prompt is the client's, not the continuation's.
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["prompt_tokens"] == want_usage["prompt_tokens"]
    after = router_metric(cluster.router_url, "pdserve_dispatch_migrations_total", 'reason="')
    assert after == before + 1
    assert not {w["endpoint"]: w["healthy"] for w in cluster.workers()}[killed]
    (survivor,) = [e for e in cluster.decode if e != killed]

    def idle() -> bool:
        d = probe_load(survivor, timeout_s=5)
        return d.num_inflight_reqs == 0 and d.num_running_reqs == 0 and d.kv_cache_usage == 0

    assert wait_until(idle, timeout_s=15), "the surviving decode still holds the request"
    # The cluster keeps serving on what is left.
    again, _, _ = _stream(cluster)
    assert again == want
