"""The admin plane on a real cluster: a router with ``--api-key-file K --admin-key-file A
--admin-host 0.0.0.0 --disagg always``, in front of the shared ``TCP`` cluster's prefill
and decode workers (vLLM, float32, mutual TLS, etcd: ``pd_server``), so KV is handed over
on every request, through real sockets. It is started as ``up`` started its own router,
plus those flags: a second router of the same workers, as ``test_openai_tenants.py``
does; this file sorts last of that cluster's (after ``test_pd_e2e_tls.py``, before the
transports'), since its fuzz may pause, abort and refit the workers.

Every route of the admin listener (listed from its own ``/openapi.json``, so a route added
later is covered) refuses a tenant's key and no key, and takes the admin key; the main
port serves no cluster views and shows a tenant only its own series. The weight-transfer
routes are off on that router (its workers have no transfer engine: ``up`` refuses
``--weight-transfer-backend`` without a GPU), so a third router of the same workers,
started as the keyed one plus ``--weight-transfer-backend nccl
--weight-transfer-allow 127.0.0.1/32``, shows an address outside the allowed network
refused before anything is contacted. Last, both ports are fuzzed through their sockets
(``http_fuzz.py``) and the cluster holds nothing afterwards."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.http_fuzz import WRONG_KEY, Cluster, check_after_fuzz, fuzz_port
from integration.pd_cases import MODEL
from integration.socket_fuzz import Port
from pdserve_testing import Server, kill_cluster, router_child, wait_until, with_flag

from pdserve.core import process
from pdserve.core.ports import free_port

pytestmark = pytest.mark.integration

ROUTER_START_TIMEOUT_S = 120
TENANTS = {"acme": "tenant-acme-key-0001", "globex": "tenant-globex-key-0002"}
ADMIN_KEY = "admin-plane-key-0001"
NCCL_INIT = {"master_port": 29511, "rank_offset": 1, "world_size": 2}


@dataclass(frozen=True)
class Plane:
    server: Server  # the shared cluster (its workers; its own router is not this one)
    root: str  # the keyed router's main port
    admin: str  # its admin listener (bound to 0.0.0.0, reached on loopback)
    transfer_admin: str  # the transfer router's admin listener
    router_log: Path  # the keyed router's

    def admin_get(self, path: str, key: str | None = ADMIN_KEY) -> httpx.Response:
        return httpx.get(self.admin + path, headers=bearer(key), timeout=10)


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def wait_router(proc: subprocess.Popen[bytes], log: Path, admin: str) -> None:
    """Until the router's admin listener (keyed: ``ADMIN_KEY``) lists both workers
    healthy."""

    def ready() -> str:
        try:
            view = httpx.get(admin + "/workers", headers=bearer(ADMIN_KEY), timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return "no /workers yet"
        return "" if [w["healthy"] for w in view["workers"]] == [True, True] else "not healthy"

    def exited() -> str | None:
        return None if proc.poll() is None else f"router: {log.read_text()[-2000:]}"

    process.wait_ready(ready, ROUTER_START_TIMEOUT_S, exited=exited, interval_s=0.5)


class KeyedRouters:
    """For the cluster ``get`` is given, started at the first ``get`` and kept (a module
    fixture cannot take the function-scoped ``pd_server``: this holds them): the keyed
    router, and beside it the transfer router, started as the keyed one plus the
    transfer flags (both at once: each start is mostly one core importing)."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder
        self._plane: Plane | None = None
        self._procs: list[subprocess.Popen[bytes]] = []

    def get(self, server: Server) -> Plane:
        if self._plane is None or self._plane.server is not server:
            self.stop()
            self._plane = self._start(server)
        return self._plane

    def _start(self, server: Server) -> Plane:
        keys = self._folder / "api-keys"
        keys.write_text("".join(f"{key} tenant={name}\n" for name, key in TENANTS.items()))
        admin_keys = self._folder / "admin-keys"
        admin_keys.write_text(f"# the operator's\n{ADMIN_KEY}\n")
        router = router_child(server)
        argv, env = router.cmdline(), router.environ()
        for flag, value in (("--admin-host", "0.0.0.0"), ("--api-key-file", str(keys)),
                            ("--admin-key-file", str(admin_keys)), ("--disagg", "always"),
                            ("--max-model-len", "1024")):
            argv = with_flag(argv, flag, value)
        transfer = ["--weight-transfer-backend", "nccl", "--weight-transfer-allow",
                    "127.0.0.1/32"]
        started: list[tuple[subprocess.Popen[bytes], Path, str, int]] = []
        for name, extra in (("router", []), ("transfer-router", transfer)):
            port, admin_port = free_port(), free_port()
            log = self._folder / f"{name}-{port}.log"
            routed = with_flag(with_flag(argv, "--port", str(port)),
                               "--admin-port", str(admin_port))
            self._procs.append(process.spawn([*routed, *extra], log_path=log, base_env=env))
            started.append((self._procs[-1], log, f"http://127.0.0.1:{admin_port}", port))
        for proc, log, admin, _ in started:
            wait_router(proc, log, admin)
        (_, log, admin, port), (_, _, transfer_admin, _) = started
        return Plane(server, f"http://127.0.0.1:{port}", admin, transfer_admin, log)

    def stop(self) -> None:
        procs, self._procs, self._plane = self._procs, [], None
        for proc in procs:
            kill_cluster(proc)


@pytest.fixture(scope="module")
def keyed_routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedRouters]:
    routers = KeyedRouters(tmp_path_factory.mktemp("admin-plane"))
    try:
        yield routers
    finally:
        routers.stop()


@pytest.fixture
def plane(pd_server: Server, keyed_routers: KeyedRouters) -> Plane:
    return keyed_routers.get(pd_server)


# ---- every admin route ---------------------------------------------------------------

def admin_routes(plane: Plane) -> list[tuple[str, str]]:
    """(method, path) of every route the admin listener serves, from its own schema."""
    schema = plane.admin_get("/openapi.json").json()
    return sorted((method.upper(), path) for path, item in schema["paths"].items()
                  for method in item)


def test_every_admin_route_refuses_a_tenant_key_and_no_key(plane: Plane) -> None:
    routes = admin_routes(plane)
    assert {("POST", "/pause"), ("POST", "/abort_requests"), ("GET", "/workers"),
            ("POST", "/init_weight_transfer_engine"), ("GET", "/metrics")} <= set(routes)
    paused_before = plane.admin_get("/is_paused").json()
    with httpx.Client(timeout=10) as http:
        for method, path in routes:
            url = plane.admin + path.replace("{worker_id}", "decode-0")
            for key in (None, *TENANTS.values()):
                reply = http.request(method, url, headers=bearer(key), content=b"{not json")
                expected = (200,) if path == "/health" else (401, 403)
                assert reply.status_code in expected, (method, path, key, reply.text)
                if reply.status_code != 200:
                    assert reply.json()["error"]["type"] in ("authentication_error",
                                                             "permission_error")
        assert http.get(plane.admin + "/openapi.json",
                        headers=bearer(TENANTS["acme"])).status_code == 401
    assert plane.admin_get("/is_paused").json() == paused_before == {"is_paused": False}


# What each route does with the admin key: a harmless call that succeeds, or (a call that
# would change the cluster: a reload, a role switch, a version, an adapter) a body the
# route refuses as invalid, which only a caller the key let in reaches. The
# weight-transfer routes are off on this router (404): the transfer router below has
# them on.
HARMLESS: dict[tuple[str, str], tuple[dict[str, Any], int]] = {
    ("GET", "/health"): ({}, 200),
    ("GET", "/metrics"): ({}, 200),
    ("GET", "/workers"): ({}, 200),
    ("GET", "/prefix_index"): ({}, 200),
    ("GET", "/weight_info"): ({}, 200),
    ("GET", "/is_paused"): ({}, 200),
    ("POST", "/abort_requests"): ({"json": {"request_ids": []}}, 200),
    ("POST", "/update_weights_from_disk"): ({"json": {}}, 400),
    ("POST", "/update_weight_version"): ({"json": {"new_version": ""}}, 400),
    ("POST", "/admin/workers/{worker_id}/role"): ({"json": {"role": "both"}}, 400),
    ("POST", "/init_weight_transfer_engine"): ({"json": {"init_info": NCCL_INIT}}, 404),
    ("POST", "/update_weights"): ({"json": {"update_info": {}}}, 404),
    ("POST", "/start_weight_update"): ({}, 404),
    ("POST", "/finish_weight_update"): ({}, 404),
    ("POST", "/shutdown_weight_transfer_engine"): ({}, 404),
    ("POST", "/v1/load_lora_adapter"): ({"json": {"lora_name": "", "lora_path": ""}}, 400),
    ("POST", "/v1/unload_lora_adapter"): ({"json": {"lora_name": ""}}, 400),
}


def test_the_admin_key_opens_every_route(plane: Plane) -> None:
    routes = admin_routes(plane)
    # /pause and /resume: one round trip below; every other route is in HARMLESS.
    assert set(routes) - {("POST", "/pause"), ("POST", "/resume")} == set(HARMLESS)
    with httpx.Client(timeout=30, headers=bearer(ADMIN_KEY)) as http:
        for (method, path), (kwargs, status) in HARMLESS.items():
            url = plane.admin + path.replace("{worker_id}", "decode-0")
            reply = http.request(method, url, **kwargs)
            assert reply.status_code == status, (method, path, reply.text)
            if status == 404:
                assert reply.json()["error"]["code"] == "weight_transfer_disabled"
        assert http.post(plane.admin + "/pause", params={"mode": "keep"}).status_code == 200
        assert http.get(plane.admin + "/is_paused").json() == {"is_paused": True}
        assert http.post(plane.admin + "/resume").status_code == 200
        assert http.get(plane.admin + "/is_paused").json() == {"is_paused": False}
        workers = http.get(plane.admin + "/workers").json()["workers"]
        assert sorted((w["role"], w["healthy"]) for w in workers) == [
            ("decode", True), ("prefill", True)]
    assert complete(plane.root, TENANTS["acme"]).status_code == 200  # still serving


def complete(root: str, key: str) -> httpx.Response:
    return httpx.post(root + "/v1/completions", headers=bearer(key), timeout=120, json={
        "model": MODEL, "prompt": "The admin plane test says", "max_tokens": 4,
        "temperature": 0})


# ---- the main port -------------------------------------------------------------------

def series(text: str) -> list[str]:
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_the_main_port_has_no_views_and_a_tenant_sees_only_its_own_series(
        plane: Plane) -> None:
    for key in TENANTS.values():
        for path in ("/workers", "/prefix_index"):
            reply = httpx.get(plane.root + path, headers=bearer(key), timeout=10)
            assert reply.status_code == 404, (path, reply.text)
    own = f'tenant="{"acme"}"'
    before = httpx.get(plane.root + "/metrics", headers=bearer(TENANTS["acme"]), timeout=10)
    assert complete(plane.root, TENANTS["acme"]).status_code == 200
    after = httpx.get(plane.root + "/metrics", headers=bearer(TENANTS["acme"]), timeout=10)
    other = httpx.get(plane.root + "/metrics", headers=bearer(TENANTS["globex"]), timeout=10)
    for text in (before.text, after.text):
        assert series(text) and all(line.startswith("pdserve:tenant_") and own in line
                                    for line in series(text)), text
    assert "vllm:" not in after.text and "pdserve:worker" not in after.text
    assert all('tenant="globex"' in line for line in series(other.text)), other.text
    assert own not in other.text

    def requests(text: str) -> float:
        (line,) = [s for s in series(text) if s.startswith("pdserve:tenant_requests_total")]
        return float(line.rsplit(" ", 1)[1])

    assert requests(after.text) == requests(before.text) + 1
    full = plane.admin_get("/metrics").text  # the admin plane: every series
    assert 'tenant="globex"' in full and own in full and "pdserve:http_requests_total" in full


# ---- weight transfer held to the allowed networks ------------------------------------



@pytest.fixture
def transfer_router(plane: Plane) -> str:
    """A third router of the same workers with the transfer routes on, allowed to send
    workers to 127.0.0.1 only (``KeyedRouters``); its admin listener's URL (keys as the
    keyed router's)."""
    return plane.transfer_admin


def test_init_weight_transfer_to_an_address_outside_the_allow_list_is_refused(
        plane: Plane, transfer_router: str) -> None:
    # A listener on an address outside the allowed /32: nothing may ever dial it.
    with socket.socket() as trap:
        trap.bind(("127.0.0.2", 0))
        trap.listen()
        trap.settimeout(2.0)
        with httpx.Client(timeout=30) as http:
            for address in ("10.1.2.3", "127.0.0.2"):
                init = dict(NCCL_INIT, master_address=address,
                            master_port=trap.getsockname()[1])
                for key in (None, TENANTS["acme"]):  # the key before anything else
                    reply = http.post(transfer_router + "/init_weight_transfer_engine",
                                      headers=bearer(key), json={"init_info": init})
                    assert reply.status_code == 401, reply.text
                reply = http.post(transfer_router + "/init_weight_transfer_engine",
                                  headers=bearer(ADMIN_KEY), json={"init_info": init})
                assert reply.status_code == 403, (address, reply.text)
                assert reply.json()["error"]["code"] == "weight_transfer_address_refused"
        with pytest.raises(TimeoutError):
            trap.accept()  # no worker (nor the router) connected to it
    # The worker is untouched: healthy, on its version, serving.
    info = httpx.get(transfer_router + "/weight_info", headers=bearer(ADMIN_KEY),
                     timeout=10).json()
    assert info == plane.admin_get("/weight_info").json()
    assert wait_until(lambda: complete(plane.root, TENANTS["globex"]).status_code == 200,
                      30, interval_s=1)


# ---- both ports fuzzed through real sockets (last: it may pause, abort, refit) ---------

def test_a_short_fuzz_of_both_ports_leaves_the_cluster_holding_nothing(plane: Plane) -> None:
    """The socket fuzz (``http_fuzz.py``; its long run is on simulated workers in
    ``test_http_fuzz_sockets.py``) on these real engines: 0 crashes, then no request,
    lease, pending transfer or KV block held, and a request served."""
    acme, globex = TENANTS["acme"], TENANTS["globex"]
    cluster = Cluster(plane.server,
                      Port("main/keys", plane.root, True, (acme, WRONG_KEY, None, globex)),
                      Port("admin/keys", plane.admin, False, (ADMIN_KEY, WRONG_KEY, None, acme)),
                      MODEL, router_log=plane.router_log)
    tallies = [(cluster.main, fuzz_port(cluster, cluster.main, 40, 30)),
               (cluster.admin, fuzz_port(cluster, cluster.admin, 30, 10))]
    check_after_fuzz(cluster, tallies, cache_too=True)
