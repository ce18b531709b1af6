"""Client API keys on every endpoint of the router (main port and admin listener), on the
real dispatcher and fake gRPC workers; and the key flags."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from fastapi import FastAPI
from unit.dispatch_cluster import Cluster, running_cluster
from unit.fakes import COMPLETIONS, asgi_http_client, cmpl_body, make_router_app

from pdserve.cli.configs import edge_config, up_config
from pdserve.cli.parser import build_parser
from pdserve.membership.static import StaticMembership
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.kv_feed import KvIndexFeeder
from pdserve.router.http.admin.app import create_admin_app
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.server import _cluster_views

KEYS = ("key-one-1234", "key-two-5678")
ADMIN_KEY = "admin-key-0001"
GETS = ("/v1/models", "/metrics")
VIEWS = ("/workers", "/prefix_index")  # the admin plane's only, with keys set


class Apps:
    def __init__(self, cluster: Cluster, main: FastAPI, admin: FastAPI) -> None:
        self.cluster, self.main, self.admin = cluster, main, admin


@pytest_asyncio.fixture(loop_scope="function")
async def apps(tokenizer: Any) -> AsyncIterator[Apps]:
    """The router as ``serve_router`` wires it: the main app with keys (and so without
    the cluster views), and the admin app with them, behind the admin key, on the same
    registry."""
    async with running_cluster() as c:
        membership = StaticMembership([c.prefill.endpoint], [c.decode.endpoint])
        index = PrefixIndex()
        views = _cluster_views(c.pool, membership, index,
                               KvIndexFeeder(lambda: c.pool.prefill, index, c.registry))
        main = make_router_app(tokenizer, c.dispatcher, EdgeConfig(api_keys=KEYS), c.registry)
        yield Apps(c, main, create_admin_app(c.registry, views, keys=(ADMIN_KEY,)))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def assert_401(reply: httpx.Response) -> None:
    assert reply.status_code == 401, reply.text
    error = reply.json()["error"]
    assert (error["type"], error["code"]) == ("authentication_error", "invalid_api_key")
    assert reply.headers["www-authenticate"] == "Bearer"


@pytest.mark.parametrize("headers", [{}, bearer("key-one-123X"), bearer("wrong"),
                                     {"Authorization": "Basic key-one-1234"},
                                     {"Authorization": "key-one-1234"}],
                         ids=["none", "near-miss", "short", "basic-scheme", "no-scheme"])
async def test_missing_or_wrong_key_is_401_everywhere_but_health(
        apps: Apps, headers: dict[str, str]) -> None:
    async with asgi_http_client(apps.main) as http:
        for path in GETS:
            assert_401(await http.get(path, headers=headers))
        for path, body in ((COMPLETIONS, cmpl_body(max_tokens=3)),
                           ("/v1/chat/completions", {"model": "x", "messages": []})):
            assert_401(await http.post(path, json=body, headers=headers))
        assert (await http.get("/health", headers=headers)).status_code == 200
    assert apps.cluster.d.generates == []  # nothing reached a worker


@pytest.mark.parametrize("key", KEYS)
async def test_each_configured_key_opens_every_endpoint(apps: Apps, key: str) -> None:
    async with asgi_http_client(apps.main) as http:
        for path in GETS:
            reply = await http.get(path, headers=bearer(key))
            assert reply.status_code == 200, (path, reply.text)
        for path in VIEWS:  # the admin plane's: not here at all
            assert (await http.get(path, headers=bearer(key))).status_code == 404
        reply = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=3), headers=bearer(key))
        assert reply.status_code == 200, reply.text
        assert len(reply.json()["choices"][0]["text"]) > 0
    async with asgi_http_client(apps.admin) as http:
        metrics = (await http.get("/metrics", headers=bearer(ADMIN_KEY))).text
    assert 'pdserve:http_requests_total{endpoint="/metrics",status_code="401"}' not in metrics
    assert [g.phase for g in apps.cluster.d.generates] == ["decode"]


async def test_401s_are_counted_by_status(apps: Apps) -> None:
    async with asgi_http_client(apps.main) as http:
        await http.post(COMPLETIONS, json=cmpl_body(), headers=bearer("nope-nope"))
    async with asgi_http_client(apps.admin) as http:
        metrics = (await http.get("/metrics", headers=bearer(ADMIN_KEY))).text
    assert ('pdserve:http_requests_total{endpoint="/v1/completions",status_code="401"} 1.0'
            in metrics)
    assert ('pdserve:request_failures_total{endpoint="/v1/completions",'
            'reason="invalid_api_key"} 1.0' in metrics)


async def test_admin_listener_serves_views_with_the_admin_key_only(apps: Apps) -> None:
    async with asgi_http_client(apps.admin) as http:
        for path in ("/metrics", *VIEWS):
            for headers in ({}, bearer(KEYS[0]), bearer(KEYS[1])):  # a client key is none
                assert_401(await http.get(path, headers=headers))
            reply = await http.get(path, headers=bearer(ADMIN_KEY))
            assert reply.status_code == 200, (path, reply.text)
        assert (await http.get("/health")).status_code == 200  # probes: no key
        workers = (await http.get("/workers", headers=bearer(ADMIN_KEY))).json()["workers"]
        assert {w["healthy"] for w in workers} == {True}
        admin = bearer(ADMIN_KEY)
        assert (await http.post(COMPLETIONS, json=cmpl_body(), headers=admin)).status_code \
            == 404
        assert (await http.get("/v1/models", headers=admin)).status_code == 404


async def test_a_tenant_reads_only_its_own_series_on_the_main_port(apps: Apps) -> None:
    async with asgi_http_client(apps.main) as http:
        sent = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=3), headers=bearer(KEYS[0]))
        assert sent.status_code == 200, sent.text
        own = (await http.get("/metrics", headers=bearer(KEYS[0]))).text
        other = (await http.get("/metrics", headers=bearer(KEYS[1]))).text
    async with asgi_http_client(apps.admin) as http:
        full = (await http.get("/metrics", headers=bearer(ADMIN_KEY))).text
    series = [line for line in own.splitlines() if line and not line.startswith("#")]
    assert series and all(line.startswith("pdserve:tenant_") and 'tenant="key-1"' in line
                          for line in series), own
    assert 'pdserve:tenant_requests_total{tenant="key-1"} 1.0' in own
    assert 'tenant="key-1"' not in other and 'tenant="key-2"' in other
    # the admin plane's /metrics has both tenants and the cluster's own series
    assert 'tenant="key-1"' in full and 'tenant="key-2"' in full
    assert "pdserve:http_requests_total" in full and "pdserve:http_requests_total" not in own


def test_keys_from_flags_environment_and_file(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# ops keys\nfile-key-0001\n\n  file-key-0002  \n")
    args = build_parser().parse_args(["router", "--api-key", "flag-key-001", "--api-key",
                                      "flag-key-002", "--api-key-file", str(key_file)])
    assert edge_config(args).api_keys == (
        "flag-key-001", "flag-key-002", "file-key-0001", "file-key-0002")
    monkeypatch.setenv("PDSERVE_API_KEY", "env-key-0001,env-key-0002")
    assert edge_config(build_parser().parse_args(["router"])).api_keys == (
        "env-key-0001", "env-key-0002")
    # A flag on the command line wins over the environment, as for every flag.
    flagged = build_parser().parse_args(["router", "--api-key", "flag-key-001"])
    assert edge_config(flagged).api_keys == ("flag-key-001",)
    key_file.write_text("has space in it\n")
    with pytest.raises(ValueError, match="api-key-file"):
        edge_config(build_parser().parse_args(["router", "--api-key-file",
                                                str(key_file)]))


def test_up_hands_the_edge_flags_to_its_router_and_keys_only_in_its_environment(
        tmp_path: Path) -> None:
    from pdserve.core.model import ResolvedModel
    from pdserve.launch.up import plan

    up = up_config(build_parser().parse_args([
        "up", "--simulated", "--api-key", KEYS[0], "--api-key", KEYS[1], "--admin-port",
        "9100", "--max-concurrent-requests", "8", "--max-queued-requests", "3",
        "--max-queue-wait-s", "2.5", "--max-body-bytes", "1000", "--drain-timeout-s", "7"]),
        ResolvedModel(Path("/models/tiny"), "tiny"))
    edge = up.edge
    assert (edge.api_keys, edge.max_concurrent, edge.drain_timeout_s) == (KEYS, 8, 7.0)
    router = plan(up, tmp_path)[-1]
    assert not any(key in arg for key in KEYS for arg in router.argv)  # not shown by ps
    # Every key in the environment, so the router reads no key file of its own.
    assert router.env == {"PDSERVE_API_KEY": ",".join(KEYS), "PDSERVE_API_KEY_FILE": ""}
    assert router.probe_headers == {}  # no admin key: the admin listener is loopback's
    assert router.probe == "http://127.0.0.1:9100/workers"
    argv = router.argv[router.argv.index("router"):]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PDSERVE_API_KEY", router.env["PDSERVE_API_KEY"])
        assert edge_config(build_parser().parse_args(argv)) == edge
