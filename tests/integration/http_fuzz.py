"""What the socket fuzz (``test_http_fuzz_sockets.py``, and the real-vLLM run in
``test_pd_e2e_tls_admin_plane.py``) needs beyond its inputs (``socket_fuzz.py``): a running
``pdserve up``'s two ports, one port's fuzz run, and the checks afterwards: no 5xx, no
timeout, the wrong key refused, nothing held by the router or the workers (requests,
leases, pending transfers, and with real engines their KV cache), a request served, and
no traceback in the router's log."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from integration.socket_fuzz import (
    TIMEOUT_S,
    Port,
    Tally,
    schema_cases,
    send_case,
    send_junk,
    send_raw_bodies,
)
from pdserve_testing import Server, wait_until

from pdserve.router.dispatch.workers.client import probe_load

WRONG_KEY = "not-a-key"
MAX_TOKENS = 16  # a drawn valid request's cap (served ones stay short)
_IN_FLIGHT = ("pdserve:requests_in_flight", "pdserve:num_requests_running",
              "pdserve:num_requests_waiting")


@dataclass
class Cluster:
    server: Server
    main: Port
    admin: Port
    model: str
    # The fuzzed router's log; None: the one ``up`` names in its own log (its router).
    router_log: Path | None = None

    @property
    def root(self) -> str:
        return self.main.url

    def get(self, port: Port, path: str) -> httpx.Response:
        return httpx.get(port.url + path, headers=port.headers(0), timeout=TIMEOUT_S)


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


def check_after_fuzz(cluster: Cluster, tallies: list[tuple[Port, Tally]], cache_too: bool) -> None:
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
    saw no 5xx): ``cluster.router_log``, or the one in up's log folder."""
    router_log = cluster.router_log
    if router_log is None:
        assert cluster.server.log_dir is not None, "up's log folder is not known"
        router_log = cluster.server.log_dir / "router.log"
    assert router_log.read_text(errors="replace").strip(), f"{router_log} is empty"
    return [line for line in router_log.read_text(errors="replace").splitlines()
            if "Traceback" in line or "Exception in ASGI" in line]
