"""The router's metrics (``router/metrics.py``, ``dispatch/workers/metrics.py``): per-worker label
sets leave with their worker, the workers-by-state view, the KV handoff per transport,
the metrics switch, and readiness (``/v1/models`` lists the model only when servable)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from unit.dispatch_cluster import ALWAYS, PROMPT, Cluster, collect, spec
from unit.fakes import (
    COMPLETIONS,
    ROUTER_MAX_MODEL_LEN,
    ROUTER_MODEL,
    FakeDispatcher,
    asgi_http_client,
    cmpl_body,
    make_router_app,
)

from pdserve.cli.parser import build_parser
from pdserve.core.logs import setup_logging
from pdserve.core.types import PhaseTiming
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.placement import RoundRobinPlacement
from pdserve.router.dispatch.workers.metrics import register_pool_metrics
from pdserve.router.http.app import create_app

PLACED = "pdserve:placement_decisions_total"


def placed(c: Cluster, role: str, worker_id: str) -> float | None:
    return c.registry.get_sample_value(PLACED, {"policy": "round_robin", "role": role,
                                                "worker_id": worker_id})


def label_sets(registry: CollectorRegistry, name: str) -> list[dict[str, str]]:
    return [s.labels for m in registry.collect() for s in m.samples if s.name == name]


async def test_placement_label_sets_leave_with_their_worker(cluster: Cluster) -> None:
    await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))
    p, d = (w.snapshot() for w in (cluster.pool.prefill[0], cluster.pool.decode[0]))
    assert placed(cluster, "prefill", p.worker_id) == 1
    assert placed(cluster, "decode", d.worker_id) == 1

    await cluster.pool.delete(cluster.pool.prefill[0].member_id)
    assert placed(cluster, "prefill", p.worker_id) is None
    assert [s["role"] for s in label_sets(cluster.registry, PLACED)] == ["decode"]


async def test_a_member_reporting_a_new_id_drops_its_old_label_set(cluster: Cluster) -> None:
    """A static member restarted: same endpoint, new worker id; the old id's series goes."""
    await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))
    decode = cluster.pool.decode[0]
    old = decode.snapshot().worker_id
    decode._report(worker_id="decode-restarted")  # what its next health check reports
    await collect(cluster.dispatcher.generate("r2", PROMPT, spec(3)))
    assert placed(cluster, "decode", old) is None
    assert placed(cluster, "decode", "decode-restarted") == 1
    decode._report(worker_id=old)  # the fixture's leak check reads the snapshot


async def test_kv_handoff_per_transport(cluster: Cluster) -> None:
    cluster.p.script.timing = PhaseTiming(compute_ns=1_000_000)
    cluster.d.script.timing = PhaseTiming(kv_load_ns=2_000_000, queue_ns=3_000_000)
    await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))
    r = cluster.registry
    assert r.get_sample_value("pdserve:kv_handoffs_total",
                              {"transport": "tcp", "mode": "pull"}) == 1
    assert r.get_sample_value("pdserve:kv_handoff_load_seconds_sum",
                              {"transport": "tcp"}) == 0.002
    assert r.get_sample_value("pdserve:kv_handoff_tokens_total",
                              {"transport": "tcp"}) == len(PROMPT)


async def test_workers_by_role_and_state(cluster: Cluster) -> None:
    registry = CollectorRegistry()
    register_pool_metrics(cluster.pool, registry)

    def workers(role: str, state: str) -> float | None:
        return registry.get_sample_value("pdserve:workers", {"role": role, "state": state})

    assert (workers("prefill", "healthy"), workers("decode", "healthy")) == (1, 1)
    cluster.pool.prefill[0].mark_unhealthy("test")
    assert (workers("prefill", "healthy"), workers("prefill", "unhealthy")) == (0, 1)
    member = cluster.pool.prefill[0].member_id
    await cluster.pool.delete(member)
    assert workers("prefill", "unhealthy") == 0
    assert registry.get_sample_value("pdserve:membership_changes_total",
                                     {"role": "prefill", "change": "left"}) == 1
    # Labelled role/id with the id the worker's Health gives, not the static member's
    # endpoint that stood in for it before.
    decode = cluster.pool.decode[0].snapshot()
    assert decode.worker_id != decode.endpoint
    assert [s["worker"] for s in label_sets(registry, "pdserve:worker_assigned_requests")] \
        == [f"decode/{decode.worker_id}"]


async def test_metrics_off_serve_requests_and_answer_404(tokenizer: Any,
                                                         cluster: Cluster) -> None:
    dispatcher = PDDispatcher(cluster.pool, RoundRobinPlacement(), None, 10.0, disagg=ALWAYS)
    app = create_app(served_model_name=ROUTER_MODEL, max_model_len=ROUTER_MAX_MODEL_LEN,
                     tokenizer=tokenizer, dispatcher=dispatcher, metrics_enabled=False)
    async with asgi_http_client(app) as http:
        reply = await http.post(COMPLETIONS, json=cmpl_body(max_tokens=3, stream=True))
        metrics = await http.get("/metrics")
    assert reply.status_code == 200 and "data: [DONE]" in reply.text
    assert metrics.status_code == 404
    assert metrics.json()["error"]["code"] == "metrics_disabled"
    assert app.state.registry is None


async def test_models_lists_the_model_only_when_servable(tokenizer: Any) -> None:
    fake = FakeDispatcher()
    async with asgi_http_client(make_router_app(tokenizer, fake)) as http:
        ready = (await http.get("/v1/models")).json()
        ready_health = (await http.get("/health")).status_code
        fake.ready = False
        empty = (await http.get("/v1/models")).json()
        empty_health = (await http.get("/health")).status_code
    assert [m["id"] for m in ready["data"]] == [ROUTER_MODEL] and ready_health == 200
    assert empty == {"object": "list", "data": []} and empty_health == 503


def test_the_switch_is_a_flag_and_an_environment_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parse = build_parser().parse_args
    assert parse(["router", "--decode", "h:1"]).disable_metrics is False
    assert parse(["router", "--decode", "h:1", "--disable-metrics"]).disable_metrics is True
    monkeypatch.setenv("PDSERVE_DISABLE_METRICS", "1")  # read when the parser is built
    assert build_parser().parse_args(["router", "--decode", "h:1"]).disable_metrics is True


def test_http_client_logs_stay_quiet_at_info() -> None:
    """``pdserve up`` polls /health through httpx, which logs every call at INFO."""
    root = logging.getLogger()
    saved = root.handlers[:], root.level, {n: logging.getLogger(n).level
                                           for n in ("httpx", "httpcore")}
    try:
        setup_logging("INFO")
        assert not logging.getLogger("httpx").isEnabledFor(logging.INFO)
        assert not logging.getLogger("httpcore").isEnabledFor(logging.INFO)
        assert logging.getLogger("httpx").isEnabledFor(logging.WARNING)
        setup_logging("DEBUG")
        assert logging.getLogger("httpx").isEnabledFor(logging.DEBUG)
    finally:
        root.handlers[:], root.level = saved[0], saved[1]
        for name, level in saved[2].items():
            logging.getLogger(name).setLevel(level)
