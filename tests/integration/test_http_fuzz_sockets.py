"""HTTP fuzzing through real sockets (issue 40): ``pdserve up`` runs the router under its
real uvicorn (main port and admin port, the express lane, the pipelining protocol), and
each port is fuzzed from its own ``/openapi.json`` (Schemathesis), with raw bodies and
with junk no client library sends (``socket_fuzz.py``), without keys and with them
(client keys on the main port, an admin key on the admin port: right, wrong and none in
turn). No answer is a 5xx, every refusal on an OpenAI route is OpenAI error JSON, and
afterwards nothing is held: the router's in-flight gauges are back to 0, the workers
hold no request, lease or pending transfer, and a request is served.

Simulated workers (``up --simulated``: real gRPC, made-up tokens) take the long fuzz;
``test_a_short_fuzz_leaves_a_vllm_cluster_holding_nothing`` runs a shorter one on real
vLLM engines (float32) and checks their KV cache is empty afterwards. Which admin
routes exist and how an admin key is given are read from the app (its openapi, the
``up`` parser), not written here. Each port's tally is printed (``-s`` shows it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.socket_fuzz import (
    TIMEOUT_S,
    Port,
    Tally,
    schema_cases,
    send_case,
    send_junk,
    send_raw_bodies,
)
from pdserve_testing import Server, kill_cluster, launch_up, wait_until

from pdserve.cli.parser import build_parser
from pdserve.core.model import prepare_default_model
from pdserve.core.ports import free_port
from pdserve.router.dispatch.workers.client import probe_load

CLIENT_KEY, TENANT_KEY, ADMIN_KEY = "fuzz-client-key-1", "fuzz-client-key-2", "fuzz-admin-key"
WRONG_KEY = "not-a-key"
SIM_STARTUP_S = 300  # the router imports transformers: ~20 s on idle cores, minutes on busy
NUM_SCHEMA = 240  # per port, over its operations
NUM_RAW = 120  # per port
MAX_TOKENS = 16  # a drawn valid request's cap (served ones stay short)
_IN_FLIGHT = ("pdserve:requests_in_flight", "pdserve:num_requests_running",
              "pdserve:num_requests_waiting")


@dataclass
class Cluster:
    server: Server
    main: Port
    admin: Port
    model: str

    @property
    def root(self) -> str:
        return self.main.url

    def get(self, port: Port, path: str) -> httpx.Response:
        return httpx.get(port.url + path, headers=port.headers(0), timeout=TIMEOUT_S)


def _admin_key_args(tmp_path: Path, key: str) -> list[str]:
    """How ``up`` takes an admin key: a file (``--admin-key-file``) where it has that flag,
    else ``--admin-key``."""
    up = next(a for a in build_parser()._actions if a.dest == "command").choices["up"]
    options = {o for a in up._actions for o in a.option_strings}
    if "--admin-key-file" in options:
        path = tmp_path / "admin-key"
        path.write_text(key + "\n")
        path.chmod(0o600)
        return ["--admin-key-file", str(path)]
    return ["--admin-key", key]


def _start(tmp_path: Path, keyed: bool, extra: list[str], startup_s: float) -> Cluster:
    port, admin_port = free_port(), free_port()
    args = [*extra, "--port", str(port), "--admin-port", str(admin_port)]
    if keyed:
        args += ["--api-key", CLIENT_KEY, "--api-key", TENANT_KEY,
                 *_admin_key_args(tmp_path, ADMIN_KEY)]
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    server = launch_up(args, env, startup_s, log_path=tmp_path / "up.log")
    label = "keys" if keyed else "open"
    main = Port(f"main/{label}", f"http://127.0.0.1:{port}", True,
                (CLIENT_KEY, WRONG_KEY, None, TENANT_KEY) if keyed else (None,))
    admin = Port(f"admin/{label}", f"http://127.0.0.1:{admin_port}", False,
                 (ADMIN_KEY, WRONG_KEY, None, CLIENT_KEY) if keyed else (None,))
    models = httpx.get(main.url + "/v1/models", headers=main.headers(0), timeout=TIMEOUT_S)
    return Cluster(server, main, admin, models.json()["data"][0]["id"])


@pytest.fixture(scope="module", params=[False, True], ids=["open", "keys"])
def sim(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("fuzz-sim")
    cluster = _start(tmp, request.param, ["--simulated", "--startup-timeout-s",
                                          str(SIM_STARTUP_S)], SIM_STARTUP_S)
    try:
        yield cluster
    finally:
        kill_cluster(cluster.server.proc)


def _prepare(model: str) -> Any:
    def prepare(case: Any) -> None:
        body = case.body
        if not isinstance(body, dict):
            return
        if isinstance(body.get("model"), str):
            body["model"] = model  # else every body is a 404 and none is served
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and MAX_TOKENS < body[key] < 10**6:
                body[key] = MAX_TOKENS
        if "model" in body and "max_tokens" not in body:
            body["max_tokens"] = MAX_TOKENS
    return prepare


def _post_paths(schema: dict[str, Any]) -> list[str]:
    return [path for path, ops in schema["paths"].items()
            if "post" in ops and "{" not in path]


def fuzz_port(cluster: Cluster, port: Port, num_schema: int, num_raw: int) -> Tally:
    schema = cluster.get(port, "/openapi.json").json()
    tally = Tally()
    cases = schema_cases(schema, num_schema, seed=40, prepare=_prepare(cluster.model))
    with httpx.Client(timeout=TIMEOUT_S) as client:
        for index, case in enumerate(cases):
            send_case(client, port, case, index, tally)
        send_raw_bodies(client, port, _post_paths(schema), cluster.model, num_raw, tally, 40)
    post = _post_paths(schema)
    path = "/v1/completions" if port.openai else (post[0] if post else "/health")
    valid = json.dumps({"model": cluster.model, "prompt": "hi", "max_tokens": 4}).encode()
    send_junk(port, path, valid, tally)
    print(tally.report(port))
    return tally


def _gauges(cluster: Cluster) -> dict[str, float]:
    """The router's in-flight gauges (summed over labels), from whichever port serves
    its full ``/metrics`` to the admin (or client) credential."""
    for port in (cluster.admin, cluster.main):
        reply = cluster.get(port, "/metrics")
        if reply.status_code == 200 and "pdserve:requests_in_flight" in reply.text:
            return {name: sum(float(v) for v in re.findall(
                rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", reply.text, re.M))
                for name in _IN_FLIGHT}
    raise AssertionError("no port serves the router's /metrics")


def _worker_endpoints(cluster: Cluster) -> list[str]:
    for port in (cluster.admin, cluster.main):
        reply = cluster.get(port, "/workers")
        if reply.status_code == 200:
            return [w["endpoint"] for w in reply.json()["workers"]]
    raise AssertionError("no port serves /workers")


def _held(cluster: Cluster) -> dict[str, dict[str, float]]:
    """What each worker holds now: requests, leases, pending transfers."""
    fields = ("num_running_reqs", "num_waiting_reqs", "num_inflight_reqs", "kv_leases_held",
              "num_pending_transfers")
    out = {}
    for endpoint in _worker_endpoints(cluster):
        load = probe_load(endpoint, 5.0, cluster.server.secret, cluster.server.tls)
        out[endpoint] = {f: getattr(load, f) for f in fields}
        out[endpoint]["kv_cache_usage"] = load.kv_cache_usage
    return out


def _nothing_held(cluster: Cluster, cache_too: bool) -> bool:
    held = _held(cluster)
    return (all(v == 0 for v in _gauges(cluster).values())
            and all(v == 0 for load in held.values() for k, v in load.items()
                    if cache_too or k != "kv_cache_usage"))


def _resume(cluster: Cluster) -> None:
    """Undo a pause the fuzz may have asked for (an admin may pause the cluster: then
    requests wait, as they should): every admin route named ``resume``, if any."""
    schema = cluster.get(cluster.admin, "/openapi.json").json()
    for path in _post_paths(schema):
        if path.rsplit("/", 1)[-1] == "resume":
            reply = httpx.post(cluster.admin.url + path, headers=cluster.admin.headers(0),
                               timeout=TIMEOUT_S)
            assert reply.status_code == 200, reply.text


def _serves(cluster: Cluster) -> None:
    body = {"model": cluster.model, "prompt": "Hello", "max_tokens": 4}
    reply = httpx.post(cluster.root + "/v1/completions", json=body,
                       headers=cluster.main.headers(0), timeout=TIMEOUT_S)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")


def _check(cluster: Cluster, tallies: list[tuple[Port, Tally]], cache_too: bool) -> None:
    for port, tally in tallies:
        assert tally.crashes == [], (tally.report(port), tally.crashes[:10])
        assert tally.timeouts == [], (tally.report(port), tally.timeouts[:10])
        assert len(tally.statuses) > 3, tally.report(port)  # more than one kind of answer
    if cluster.main.keys != (None,):  # the wrong key was refused somewhere
        assert tallies[0][1].statuses[401] > 0, tallies[0][1].report(tallies[0][0])
    _resume(cluster)
    assert wait_until(lambda: _nothing_held(cluster, cache_too), 60), (
        _gauges(cluster), _held(cluster))
    _serves(cluster)
    assert wait_until(lambda: _nothing_held(cluster, cache_too), 30)
    errors = _router_log_errors(cluster)
    assert errors == [], errors[:20]


def _router_log_errors(cluster: Cluster) -> list[str]:
    """The router's tracebacks (a handler that raised, even where the client had gone and
    saw no 5xx): its log is in the folder ``up`` names in its own log."""
    text = cluster.server.log_path.read_text(errors="replace") if cluster.server.log_path \
        else ""
    folders = re.findall(r"(/\S+/logs/\d{8}-\d{6})", text)
    assert folders, "up's log names no log folder"
    router_log = Path(folders[-1]) / "router.log"
    return [line for line in router_log.read_text(errors="replace").splitlines()
            if "Traceback" in line or "Exception in ASGI" in line]


def test_fuzz_on_simulated_workers_finds_no_5xx_and_leaves_nothing_held(sim: Cluster) -> None:
    tallies = [(port, fuzz_port(sim, port, NUM_SCHEMA, NUM_RAW))
               for port in (sim.main, sim.admin)]
    _check(sim, tallies, cache_too=False)  # a simulated prefix cache stays full


def test_a_short_fuzz_leaves_a_vllm_cluster_holding_nothing(tmp_path: Path) -> None:
    prepare_default_model()
    cluster = _start(tmp_path, True, ["--dtype", "float32", "--kv-cache-gib", "1",
                                      "--max-model-len", "1024", "--disagg", "always",
                                      "--startup-timeout-s", "600"], 600)
    try:
        tallies = [(cluster.main, fuzz_port(cluster, cluster.main, 60, 40)),
                   (cluster.admin, fuzz_port(cluster, cluster.admin, 40, 10))]
        _check(cluster, tallies, cache_too=True)
    finally:
        kill_cluster(cluster.server.proc)
