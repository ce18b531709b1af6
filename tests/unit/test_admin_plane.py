"""The admin plane (``router/http/admin/``) in process: its own key, checked on every
route before the body is read; the body limit; pydantic bodies; the weight-transfer
routes off without a backend and held to the allowed networks before any worker is
called; the config rules (a client key is never an admin key, loopback without one)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from fastapi.routing import APIRoute
from starlette.types import Message, Receive, Scope, Send

from pdserve.cli.configs import HANDED_TO_ROUTER, edge_config, handed_on
from pdserve.cli.parser import build_parser
from pdserve.core.weight_calls import (
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    TransferInitInfo,
    TransferUpdateInfo,
    UpdateWeights,
    UpdateWeightVersion,
    WeightCall,
)
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.cluster.weight_updates import WeightUpdater
from pdserve.router.dispatch.weights import WeightGate
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.http.admin.actions import admin_actions
from pdserve.router.http.admin.app import create_admin_app
from pdserve.router.http.admin.auth import PUBLIC_PATHS
from pdserve.router.http.admin.transfer import WeightTransferPolicy
from pdserve.router.http.edge.config import EdgeConfig

ADMIN = "admin-key-0001"
CLIENT = "client-key-0001"
NCCL_INIT: dict[str, Any] = {"master_address": "127.0.0.1", "master_port": 29500, "rank_offset": 1,
                             "world_size": 3}


class RecordingUpdater(WeightUpdater):
    """A weight updater on no workers that records each engine call it would pass on."""

    def __init__(self) -> None:
        super().__init__(WorkerPool(prefill=[], decode=[]), WeightGate())
        self.calls: list[WeightCall] = []

    async def engine_call(self, call: WeightCall) -> dict[str, str]:
        self.calls.append(call)
        return {}


def admin_app(updater: RecordingUpdater, keys: tuple[str, ...] = (ADMIN,),
              transfer: WeightTransferPolicy | None = None, bind_host: str = "0.0.0.0",
              max_body_bytes: int = 4096) -> FastAPI:
    actions = admin_actions(RoleSwitcher(WorkerPool(prefill=[], decode=[])), updater,
                            transfer or WeightTransferPolicy("nccl", ("127.0.0.0/8",)))
    return create_admin_app(None, actions, keys=keys, bind_host=bind_host,
                            max_body_bytes=max_body_bytes)


@pytest_asyncio.fixture(loop_scope="function")
async def updater() -> AsyncIterator[RecordingUpdater]:
    yield RecordingUpdater()


def client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://admin")


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def routes_of(app: FastAPI) -> list[tuple[str, str]]:
    """Every (method, path) the app serves: a route added later is covered too."""
    return sorted((method, route.path.replace("{worker_id}", "w-1"))
                  for route in app.routes if isinstance(route, APIRoute)
                  for method in route.methods)


# ---- the key, before anything else -----------------------------------------------------

async def test_every_route_but_health_needs_the_admin_key_never_a_client_key(
        updater: RecordingUpdater) -> None:
    app = admin_app(updater)
    routes = routes_of(app)
    assert ("POST", "/init_weight_transfer_engine") in routes and len(routes) > 10
    async with client(app) as http:
        for method, path in routes:
            for headers in ({}, bearer(CLIENT), {"Authorization": f"Basic {ADMIN}"}):
                reply = await http.request(method, path, headers=headers, content=b"{oops")
                expected = 200 if path in PUBLIC_PATHS else 401
                assert reply.status_code == expected, (method, path, headers, reply.text)
                if expected == 401:
                    assert reply.json()["error"]["type"] == "authentication_error"
    assert updater.calls == [] and not updater.paused
    assert PUBLIC_PATHS == {"/health"}


class _Receive:
    """A body source that records whether the app ever asked for the body."""

    def __init__(self, body: bytes) -> None:
        self.body, self.reads = body, 0

    async def __call__(self) -> Message:
        self.reads += 1
        return {"type": "http.request", "body": self.body, "more_body": False}


async def _call(app: FastAPI, path: str, headers: dict[str, str], body: bytes
                ) -> tuple[int, int]:
    """(status, body reads) of one POST straight through ASGI."""
    receive = _Receive(body)
    status = 0

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    scope: Scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                    "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
                    "query_string": b"", "root_path": "", "server": ("127.0.0.1", 8001),
                    "client": ("127.0.0.1", 5000),
                    "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]
                    + [(b"content-type", b"application/json"),
                       (b"content-length", str(len(body)).encode())]}
    sink: Send = send
    source: Receive = receive
    await app(scope, source, sink)
    return status, receive.reads


async def test_a_bad_body_without_the_key_is_401_and_never_read(
        updater: RecordingUpdater) -> None:
    app = admin_app(updater)
    for path in ("/abort_requests", "/init_weight_transfer_engine", "/update_weights_from_disk"):
        assert await _call(app, path, {}, b"{not json") == (401, 0)
        assert await _call(app, path, bearer(CLIENT), b"{not json") == (401, 0)
        status, reads = await _call(app, path, bearer(ADMIN), b"{not json")
        assert (status, reads) == (400, 1)  # with the key: read, parsed, refused
    assert updater.calls == []


async def test_the_body_limit_comes_after_the_key(updater: RecordingUpdater) -> None:
    app = admin_app(updater, max_body_bytes=64)
    big = b'{"request_ids": ["' + b"x" * 100 + b'"]}'
    assert await _call(app, "/abort_requests", {}, big) == (401, 0)
    async with client(app) as http:
        reply = await http.post("/abort_requests", content=big, headers=bearer(ADMIN))
        assert reply.status_code == 413 and reply.json()["error"]["code"] is not None


async def test_without_keys_the_plane_is_open_on_loopback_only(
        updater: RecordingUpdater) -> None:
    async with client(admin_app(updater, keys=(), bind_host="127.0.0.1")) as http:
        assert (await http.get("/is_paused")).json() == {"is_paused": False}
    async with client(admin_app(updater, keys=(), bind_host="0.0.0.0")) as http:
        refused = await http.get("/is_paused")
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "admin_key_required"


# ---- bodies --------------------------------------------------------------------------

async def test_bodies_and_queries_are_validated_as_openai_errors(
        updater: RecordingUpdater) -> None:
    async with client(admin_app(updater)) as http:
        key = bearer(ADMIN)
        for method, path, kwargs in (
                ("POST", "/abort_requests", {"json": {"request_ids": "all"}}),
                ("POST", "/abort_requests", {"json": {"request_ids": [1, 2]}}),
                ("POST", "/pause", {"params": {"mode": "later"}}),
                ("POST", "/pause", {"params": {"made": "abort"}}),
                ("POST", "/init_weight_transfer_engine", {"json": {"init_info": "x"}}),
                ("POST", "/update_weights", {"json": {}}),
                ("POST", "/update_weight_version", {"json": {"new_version": ""}}),
                ("POST", "/finish_weight_update", {"json": {"weight_version": ""}})):
            reply = await http.request(method, path, headers=key, **kwargs)
            assert reply.status_code == 400, (path, kwargs, reply.text)
            assert reply.json()["error"]["type"] == "invalid_request_error"
        assert (await http.post("/abort_requests", headers=key)).json()["aborted"] == 0
        assert (await http.post("/abort_requests", headers=key,
                                json={"request_ids": []})).json()["aborted"] == 0
        assert (await http.post("/pause", params={"mode": "keep"}, headers=key)).json() == {
            "status": "paused"}
        assert (await http.get("/is_paused", headers=key)).json() == {"is_paused": True}
        await http.post("/resume", headers=key)
        assert not updater.paused
    assert updater.calls == []


# ---- weight transfer -----------------------------------------------------------------

async def test_transfer_routes_are_404_without_a_backend(updater: RecordingUpdater) -> None:
    async with client(admin_app(updater, transfer=WeightTransferPolicy())) as http:
        for path, body in (("/init_weight_transfer_engine", {"init_info": NCCL_INIT}),
                           ("/update_weights", {"update_info": {"names": []}}),
                           ("/start_weight_update", None), ("/finish_weight_update", None),
                           ("/shutdown_weight_transfer_engine", None)):
            reply = await http.post(path, json=body, headers=bearer(ADMIN))
            assert reply.status_code == 404, (path, reply.text)
            assert reply.json()["error"]["code"] == "weight_transfer_disabled"
    assert updater.calls == []


@pytest.mark.parametrize("init_info", [
    dict(NCCL_INIT, master_address="10.1.2.3"),
    dict(NCCL_INIT, master_address="::ffff:10.1.2.3"),
    dict(NCCL_INIT, master_address="no-such-host.invalid"),
], ids=["outside", "mapped-v6", "unresolvable"])
async def test_an_address_outside_the_allowed_networks_is_refused_before_any_worker(
        updater: RecordingUpdater, init_info: dict[str, Any]) -> None:
    async with client(admin_app(updater)) as http:
        reply = await http.post("/init_weight_transfer_engine", json={"init_info": init_info},
                                headers=bearer(ADMIN))
    assert reply.status_code == 403, reply.text
    assert reply.json()["error"]["code"] == "weight_transfer_address_refused"
    assert updater.calls == []


@pytest.mark.parametrize("init_info", [
    dict(NCCL_INIT, nested={"peer_host": "192.168.0.9"}),
    dict(NCCL_INIT, store_hosts=["127.0.0.2", "8.8.8.8"]),
    dict(NCCL_INIT, init_method="tcp://8.8.8.8:29500"),  # no host-like name at all
], ids=["nested-host", "one-of-a-list", "url-field"])
async def test_a_field_the_backends_engine_does_not_take_is_refused_before_any_worker(
        updater: RecordingUpdater, init_info: dict[str, Any]) -> None:
    """Only vLLM's own fields of the named backend pass: a host under a name the host
    check would not know cannot reach the workers."""
    async with client(admin_app(updater)) as http:
        reply = await http.post("/init_weight_transfer_engine", json={"init_info": init_info},
                                headers=bearer(ADMIN))
    assert reply.status_code == 400, reply.text
    unknown = (set(init_info) - set(NCCL_INIT)).pop()
    assert unknown in reply.json()["error"]["message"]
    assert updater.calls == []


def test_an_unknown_weight_transfer_backend_is_refused_naming_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="ipc, nccl"):
        WeightTransferPolicy("rdma", ("127.0.0.0/8",))


async def test_allowed_addresses_pass_and_names_are_pinned_to_the_checked_address(
        updater: RecordingUpdater) -> None:
    async with client(admin_app(updater)) as http:
        key = bearer(ADMIN)
        ok = await http.post("/init_weight_transfer_engine", json={"init_info": NCCL_INIT},
                             headers=key)
        assert ok.status_code == 200, ok.text
        named = await http.post("/init_weight_transfer_engine", headers=key, json={
            "init_info": dict(NCCL_INIT, master_address="localhost")})
        assert named.status_code in (200, 403), named.text  # localhost may resolve to ::1
        bad_type = await http.post("/init_weight_transfer_engine", headers=key, json={
            "init_info": dict(NCCL_INIT, master_address=42)})
        assert bad_type.status_code == 400
        pickled = await http.post("/update_weights", headers=key, json={
            "update_info": {"names": ["w"], "ipc_handles_pickled": "gASVAAAA"}})
        assert pickled.status_code == 403
        assert pickled.json()["error"]["code"] == "pickle_refused"
    assert updater.calls[0] == InitWeightTransferEngine(TransferInitInfo(**NCCL_INIT))
    if named.status_code == 200:
        second = updater.calls[1]
        assert isinstance(second, InitWeightTransferEngine)
        assert second.init_info.master_address == "127.0.0.1"
    assert not any(isinstance(call, UpdateWeights) for call in updater.calls)


async def test_each_route_passes_its_own_typed_call_with_the_bodys_fields(
        updater: RecordingUpdater) -> None:
    update = {"names": ["lm_head.weight", "norm.weight"], "dtype_names": ["float32"] * 2,
              "shapes": [[49152, 576], [576]]}
    async with client(admin_app(updater)) as http:
        key = bearer(ADMIN)
        for path, body in (("/init_weight_transfer_engine", {"init_info": NCCL_INIT}),
                           ("/start_weight_update", None),
                           ("/update_weights", {"update_info": update}),
                           ("/finish_weight_update", None),
                           ("/finish_weight_update", {"weight_version": "v2"}),
                           ("/update_weight_version", {"new_version": "v3"}),
                           ("/shutdown_weight_transfer_engine", None)):
            reply = await http.post(path, json=body, headers=key)
            assert reply.status_code == 200, (path, reply.text)
    assert updater.calls == [
        InitWeightTransferEngine(TransferInitInfo(**NCCL_INIT)), StartWeightUpdate(),
        UpdateWeights(TransferUpdateInfo(names=("lm_head.weight", "norm.weight"),
                                         dtype_names=("float32", "float32"),
                                         shapes=((49152, 576), (576,)))),
        FinishWeightUpdate(None), FinishWeightUpdate("v2"), UpdateWeightVersion("v3"),
        ShutdownWeightTransferEngine()]


@pytest.mark.parametrize(("path", "body", "where"), [
    ("/init_weight_transfer_engine", {"init_info": dict(NCCL_INIT, master_port="29500")},
     "init_info.master_port"),
    ("/init_weight_transfer_engine", {"init_info": dict(NCCL_INIT, world_size=0)},
     "init_info.world_size"),
    ("/update_weights", {"update_info": {"names": ["a", "b"], "dtype_names": ["float32"],
                                         "shapes": [[1], [2]]}}, "as long as each other"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[-1]]}}, "update_info.shapes"),
    ("/update_weights", {"update_info": {"names": ["a"], "dtype_names": ["float32"],
                                         "shapes": [[1]], "ipc_handles": [{}]}},
     "ipc_handles"),
], ids=["port-as-string", "empty-world", "ragged-lists", "negative-dim", "ipc-handles"])
async def test_a_field_of_the_wrong_type_is_a_400_before_any_worker(
        updater: RecordingUpdater, path: str, body: dict[str, Any], where: str) -> None:
    """The typed call's fields are checked at the edge: a port as a string, a negative
    dimension or lists of different lengths never reach a worker's engine."""
    async with client(admin_app(updater)) as http:
        reply = await http.post(path, json=body, headers=bearer(ADMIN))
    assert reply.status_code == 400, reply.text
    assert where in reply.json()["error"]["message"]
    assert updater.calls == []


async def test_with_no_allowed_network_every_address_is_refused(
        updater: RecordingUpdater) -> None:
    transfer = WeightTransferPolicy("nccl", ())
    async with client(admin_app(updater, transfer=transfer)) as http:
        reply = await http.post("/init_weight_transfer_engine", json={"init_info": NCCL_INIT},
                                headers=bearer(ADMIN))
    assert reply.status_code == 403 and updater.calls == []


# ---- config rules --------------------------------------------------------------------

def test_a_client_key_is_never_an_admin_key() -> None:
    with pytest.raises(ValueError, match="admin key"):
        EdgeConfig(api_keys=(CLIENT,), admin_keys=(CLIENT,))
    edge = EdgeConfig(api_keys=(CLIENT,))
    assert edge.admin_keys == () and edge.admin_probe_headers() == {}


@pytest.mark.parametrize("host,keys,bound", [
    ("0.0.0.0", (), "127.0.0.1"), ("10.0.0.5", (), "127.0.0.1"), ("::", (), "::1"),
    ("127.0.0.1", (), "127.0.0.1"), ("localhost", (), "localhost"), ("::1", (), "::1"),
    ("0.0.0.0", (ADMIN,), "0.0.0.0"), ("10.0.0.5", (ADMIN,), "10.0.0.5")])
def test_without_an_admin_key_the_listener_binds_loopback(
        host: str, keys: tuple[str, ...], bound: str) -> None:
    from pdserve.router.server import admin_bind_note

    edge = EdgeConfig(admin_host=host, admin_port=8001, admin_keys=keys)
    assert edge.admin_bind_host == bound
    # said at start whenever the listener is not where --admin-host asked
    assert (admin_bind_note(edge) != "") == (bound != host)
    if bound != host:
        assert bound in admin_bind_note(edge) and "--admin-key-file" in admin_bind_note(edge)


def test_admin_keys_from_file_flag_and_environment(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "admin-keys"
    path.write_text("# ops\nadmin-file-key-1\n\n  admin-file-key-2 \n")
    args = build_parser().parse_args(["router", "--admin-key", "admin-flag-key",
                                      "--admin-key-file", str(path)])
    assert edge_config(args).admin_keys == ("admin-flag-key", "admin-file-key-1",
                                            "admin-file-key-2")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY_FILE", str(path))
    assert edge_config(build_parser().parse_args(["router"])).admin_keys == (
        "admin-file-key-1", "admin-file-key-2")
    path.write_text("secret-but-has space\n")
    with pytest.raises(ValueError, match="line 1") as err:
        edge_config(build_parser().parse_args(["router"]))
    assert "secret" not in str(err.value)
    path.write_text("shared-key-0001\n")
    with pytest.raises(ValueError, match="admin key"):
        edge_config(build_parser().parse_args(["router", "--api-key", "shared-key-0001"]))


def test_transfer_flags_reach_the_edge_and_its_children(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    args = build_parser().parse_args([
        "router", "--weight-transfer-backend", "nccl", "--weight-transfer-allow",
        "10.0.0.0/8", "--weight-transfer-allow", "192.168.1.7"])
    edge = edge_config(args)
    assert (edge.weight_transfer_backend, edge.weight_transfer_allow) == (
        "nccl", ("10.0.0.0/8", "192.168.1.7/32"))
    # as up hands them to its router: as parsed
    again = edge_config(build_parser().parse_args(["router",
                                                   *handed_on(args, HANDED_TO_ROUTER)]))
    assert again == edge
    with pytest.raises(SystemExit):
        build_parser().parse_args(["router", "--weight-transfer-allow", "10.0.0.0/33"])
    with pytest.raises(ValueError, match="needs --weight-transfer-backend"):
        edge_config(build_parser().parse_args(["router", "--weight-transfer-allow",
                                               "10.0.0.0/8"]))


def test_up_hands_admin_keys_to_its_router_in_the_environment_only(tmp_path: Path) -> None:
    from pdserve.launch.up import UpConfig, plan

    edge = EdgeConfig(api_keys=(CLIENT,), admin_keys=(ADMIN,), admin_host="0.0.0.0",
                      admin_port=9200)
    router = plan(UpConfig(model="/models/tiny", edge=edge), tmp_path)[-1]
    assert not any(ADMIN in arg or CLIENT in arg for arg in router.argv)
    assert router.env["PDSERVE_ADMIN_KEY"] == ADMIN
    assert router.env["PDSERVE_ADMIN_KEY_FILE"] == ""  # the router reads no file of its own
    # up's readiness probe reads the views where they are: the admin plane, with its key
    assert router.probe == "http://127.0.0.1:9200/workers"
    assert router.probe_headers == bearer(ADMIN)


def test_up_gives_a_keyed_router_without_an_admin_port_one_on_loopback(tmp_path: Path
                                                                       ) -> None:
    from pdserve.launch.up import UpConfig, plan

    router = plan(UpConfig(model="/models/tiny", edge=EdgeConfig(api_keys=(CLIENT,))),
                  tmp_path)[-1]
    port = int(router.argv[router.argv.index("--admin-port") + 1])
    assert port > 0 and router.probe == f"http://127.0.0.1:{port}/workers"


# ---- the router as serve_router wires it ---------------------------------------------

@pytest.mark.parametrize("keys", [(), (CLIENT,)], ids=["open", "keyed"])
async def test_the_main_port_keeps_the_views_only_without_api_keys(
        tokenizer: Any, keys: tuple[str, ...]) -> None:
    from unit.fakes import ROUTER_MODEL

    from pdserve.router.server import RouterConfig, admin_app, build_router

    edge = EdgeConfig(api_keys=keys, admin_keys=(ADMIN,), admin_port=9300)
    router = build_router(RouterConfig(model_path="unused", served_model_name=ROUTER_MODEL,
                                       prefill=(), decode=("127.0.0.1:9",), edge=edge),
                          tokenizer)
    main_headers = bearer(CLIENT) if keys else {}
    try:
        async with client(router.app) as http:
            for path in ("/workers", "/prefix_index"):
                reply = await http.get(path, headers=main_headers)
                assert reply.status_code == (404 if keys else 200), (path, reply.text)
            # open: the full /metrics; keyed: the caller's tenant series only
            metrics = (await http.get("/metrics", headers=main_headers)).text
            assert ("pdserve:http_requests_total" in metrics) == (not keys)
        async with client(admin_app(router, edge)) as http:
            for path in ("/workers", "/prefix_index", "/metrics"):
                assert (await http.get(path, headers=main_headers)).status_code == 401
                assert (await http.get(path, headers=bearer(ADMIN))).status_code == 200
    finally:
        await router.close()


def test_each_router_process_has_its_admin_listener_behind_the_same_keys(
        tmp_path: Path) -> None:
    """``--processes N``: process i's admin listener on --admin-port + i, each with the
    admin keys (its key file read again) and the weight-transfer rules."""
    from pdserve.cli.configs import router_config
    from pdserve.core.model import ResolvedModel
    from pdserve.launch.router_processes import child_argv

    path = tmp_path / "admin-keys"
    path.write_text(f"{ADMIN}\n")
    argv = ["router", "--decode", "127.0.0.1:9", "--admin-port", "9500", "--admin-host",
            "0.0.0.0", "--admin-key-file", str(path), "--weight-transfer-backend", "nccl",
            "--weight-transfer-allow", "10.0.0.0/8", "--processes", "3"]
    model = ResolvedModel(tmp_path, "tiny")
    parent = router_config(build_parser().parse_args(argv), model)
    ledger = tmp_path / "ledger"
    for index in range(3):
        line = child_argv(argv, parent, 3, index, ledger)
        edge = router_config(build_parser().parse_args(line[line.index("router"):]),
                             model).edge
        assert edge.admin_port == 9500 + index and edge.admin_keys == (ADMIN,)
        assert edge.tenant_ledger == str(ledger)  # the processes share the tenants' limits
        assert edge.admin_bind_host == "0.0.0.0"
        assert (edge.weight_transfer_backend, edge.weight_transfer_allow) == (
            "nccl", ("10.0.0.0/8",))
