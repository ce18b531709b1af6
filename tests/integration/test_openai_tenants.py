"""``--tenant-isolation key`` on real vLLM: each API key is a tenant, and tenants share
no cached tokens though no request sends a ``cache_salt``.

A second router, started with two API keys and ``--tenant-isolation key``, serves the
shared tcp cluster's workers beside the cluster's own (unkeyed) router: the same
router command line ``pdserve up`` gave that one, on another port, with the keys in its
environment as ``up`` hands them (``EdgeConfig.env``). No engine starts. The cluster
runs ``--disagg auto``, so the path is forced as in ``test_openai_surface.py``: a
prompt of one full block but under the cluster's local-prefill limit runs on decode
alone (``local``), a longer one goes prefill -> decode (``remote``); the
``x-pdserve-disagg`` header proves which each request took. This file sorts right after
``test_openai_surface.py``, on the same cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from integration.pd_cases import MODEL
from pdserve_testing import Server, kill_cluster, router_child, with_flag

from pdserve.core import process
from pdserve.core.cluster_secret import load_cluster_secret
from pdserve.core.ports import free_port
from pdserve.router.http.tenants.salt import tenant_salt

pytestmark = pytest.mark.integration

KEYS = ("tenant-one-key-0001", "tenant-two-key-0002")
PATHS = ("local", "remote")
ROUTER_START_TIMEOUT_S = 120  # the router loads the tokenizer and vLLM's tool parser
# Texts no other test sends: ~200 tokens (one full block, under the cluster's 256-token
# local-prefill limit) and ~420 (three full blocks).
TEXTS = {"local": " ".join(f"Row {i}: the ferry leaves the pier at noon." for i in range(16)),
         "remote": " ".join(f"Line {i}: the orchard gate stays shut in winter."
                            for i in range(34))}




class KeyedRouter:
    """A second router of the running cluster, with ``KEYS`` as tenants: ``get`` starts
    it (once per cluster) and returns its base URL; ``stop`` kills it."""

    def __init__(self, log_dir: Path) -> None:
        self._log_dir = log_dir
        self._proc: Any = None
        self._cluster: Any = None
        self.url = ""

    def get(self, server: Server) -> str:
        if self._cluster is not server.proc:
            self.stop()
            self._start(server)
        return self.url

    def _start(self, server: Server) -> None:
        router = router_child(server)
        port, admin_port = free_port(), free_port()
        argv = with_flag(with_flag(with_flag(router.cmdline(), "--port", str(port)),
                                     "--admin-port", str(admin_port)),
                          "--tenant-isolation", "key")
        log = self._log_dir / f"router-{port}.log"
        self._proc = process.spawn(argv, log_path=log, base_env=router.environ(),
                                   env={"PDSERVE_API_KEY": ",".join(KEYS)})
        self._cluster = server.proc
        url = f"http://127.0.0.1:{port}"
        num_workers = len(server.workers("prefill")) + len(server.workers("decode"))

        def ready() -> str:
            try:
                # with keys the views are the admin plane's (loopback, no admin key: open)
                view = httpx.get(f"http://127.0.0.1:{admin_port}/workers", timeout=2).json()
            except (httpx.HTTPError, ValueError) as exc:
                return f"no /workers yet ({exc})"
            healthy = sum(w["healthy"] for w in view["workers"])
            return "" if healthy == num_workers else f"{healthy}/{num_workers} healthy"

        def exited() -> str | None:
            return None if self._proc.poll() is None else f"router: {log.read_text()[-2000:]}"

        process.wait_ready(ready, ROUTER_START_TIMEOUT_S, exited=exited, interval_s=0.5)
        self.url = f"{url}/v1"

    def stop(self) -> None:
        proc, self._proc, self._cluster = self._proc, None, None
        if proc is not None:
            kill_cluster(proc)


@pytest.fixture(scope="module")
def keyed_routers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KeyedRouter]:
    routers = KeyedRouter(tmp_path_factory.mktemp("keyed-router"))
    try:
        yield routers
    finally:
        routers.stop()


@pytest.fixture
def keyed_router(pd_server: Server, keyed_routers: KeyedRouter) -> str:
    return keyed_routers.get(pd_server)


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _cached(base_url: str, path: str, key: str | None, salt: str | None = None) -> int:
    """The cached tokens of one completion of ``path``'s text (which took ``path``)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": TEXTS[path], "max_tokens": 2,
                            "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    reply = httpx.post(f"{base_url}/completions", json=body, timeout=120,
                       headers=_auth(key) if key else {})
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdserve-disagg"].startswith(path), reply.headers
    return reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("path", PATHS)
def test_api_keys_are_tenants_that_share_no_cached_tokens(
        pd_server: Server, keyed_router: str, path: str) -> None:
    """Forced on the engine: the second request of a tenant finds the prompt in the
    engine's prefix cache (decode's for ``local``, prefill's for ``remote``); the
    other tenant's, with no ``cache_salt`` or with one chosen to collide with the first
    tenant's (its derived salt's hash part, or its key), finds nothing, and neither does
    an unsalted request through the cluster's own router; the derived salt itself is
    refused even there (no isolation: a client's salt passes through, but no client
    salt may start with ``@``); the second tenant then hits its own cache."""
    one, two = KEYS
    assert _cached(keyed_router, path, one) == 0
    assert _cached(keyed_router, path, one) >= 128
    assert _cached(keyed_router, path, two) == 0
    argv = router_child(pd_server).cmdline()  # up gives its router a cluster secret
    secret = load_cluster_secret(argv[argv.index("--cluster-secret-file") + 1])
    derived = tenant_salt(secret, one.encode())
    for salt in (derived.removeprefix("@"), one):
        assert _cached(keyed_router, path, two, salt) == 0
    assert _cached(pd_server.base_url, path, None) == 0
    refused = httpx.post(f"{pd_server.base_url}/completions", timeout=30, json={
        "model": MODEL, "prompt": TEXTS[path], "max_tokens": 2, "cache_salt": derived})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "cache_salt"
    assert _cached(keyed_router, path, two) >= 128
