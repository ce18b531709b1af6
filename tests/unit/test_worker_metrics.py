"""A worker's ``/metrics`` (``--metrics-port``, no vLLM): every ``pdserve:*`` name with
its type, parsed by prometheus-client's parser, on a simulated worker and on the
engine host (fake engine, real KV endpoint) whose connector counters move with a
transfer; port 0 listens nowhere; ``pdserve up --simulated`` prints each component's
target after its endpoint line, writes them as file_sd JSON, and shows each worker's
in the router's ``/workers``."""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import fields
from pathlib import Path
from typing import Any, cast

import httpx
import psutil
import pytest
import torch
from pdserve_testing import launch_up, make_caches, start_transport, stop_up
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cli.configs import up_config
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.core.ports import free_port
from pdserve.core.types import PhaseRequest, SamplingSpec, WorkerHealth, WorkerLoadReport
from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.launch.sim_worker import sim_host
from pdserve.launch.up import plan
from pdserve.launch.up_targets import file_sd, scrape_targets, write_file_sd
from pdserve.membership import WorkerInfo
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.router.dispatch.workers.client import WorkerClient
from pdserve.worker.backend import WorkerBackend
from pdserve.worker.engine import Engine, EngineConfig
from pdserve.worker.host import EngineHost
from pdserve.worker.metrics import (
    MetricsListener,
    MetricsServer,
    WorkerCollector,
    WorkerSample,
    start_worker_metrics,
)
from pdserve.worker.servicer import WorkerServer, start_worker_server
from pdserve.worker.sim.engine import SimConfig
from pdserve.worker.vllm.kv_status import ConnectorStatus

COUNTERS = ("kv_transfers_completed", "kv_transfers_failed", "kv_transfer_bytes_sent",
            "kv_transfer_bytes_received", "kv_transfer_seconds", "kv_loads", "kv_load_seconds",
            "kv_push_loads", "kv_push_fallbacks", "kv_layers_pushed", "kv_pushes_failed",
            "kv_leases_expired", "kv_encoded_pulls", "kv_encoded_bytes_saved",
            "kv_encoded_pull_refusals")
# GetLoad's kv_tier_* (host), kv_disk_* and kv_pool_* fields, each as kv_<tier>_<field>_total
# (*_time_ns as *_seconds).
TIER_COUNTERS = (
    *(f"kv_{tier}_{name}" for tier in ("tier", "disk", "pool") for name in (
        "loads", "load_blocks", "load_bytes", "load_seconds", "load_failures")),
    *(f"kv_{tier}_{name}" for tier in ("tier", "disk") for name in (
        "saves", "save_blocks", "save_failures", "evictions")),
    "kv_tier_miss_blocks", "kv_pool_serves", "kv_pool_serve_blocks", "kv_pool_serve_failures",
    "kv_pool_load_refusals", "kv_pool_serve_refusals")
GAUGES = ("kv_leases_held", "kv_pending_transfers", "kv_push_inbox_bytes",
          "worker_inflight_requests", "worker_ready", "worker_info")
LABELS = {"model_name", "role", "transport"}
STARTUP_TIMEOUT_S = 90  # up's router imports transformers: ~20 s on two busy cores


def scrape(endpoint: str) -> dict[str, tuple[str, dict[str, str], float]]:
    """sample name -> (family type, labels, value); every family parsed."""
    reply = httpx.get(f"http://{endpoint}/metrics", timeout=10)
    reply.raise_for_status()
    out = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out[sample.name] = (family.type, sample.labels, sample.value)
    return out


def value(metrics: dict[str, tuple[str, dict[str, str], float]], name: str) -> float:
    return metrics[f"pdserve:{name}"][2]


def check_names(metrics: dict[str, tuple[str, dict[str, str], float]], role: str) -> None:
    for name in COUNTERS + TIER_COUNTERS:
        kind, labels, _ = metrics[f"pdserve:{name}_total"]
        assert kind == "counter" and set(labels) == LABELS and labels["role"] == role, name
    for name in GAUGES:
        kind, labels, _ = metrics[f"pdserve:{name}"]
        assert kind == "gauge", name
        assert set(labels) == (LABELS | {"worker_id", "version"} if name == "worker_info"
                               else LABELS), name


@asynccontextmanager
async def serving(backend: WorkerBackend, metrics_port: int
                  ) -> AsyncIterator[tuple[WorkerServer, MetricsServer | None]]:
    worker = await start_worker_server(backend)
    server = start_worker_metrics(MetricsListener("127.0.0.1", metrics_port, "127.0.0.1"),
                                  backend, worker.state)
    try:
        yield worker, server
    finally:
        await worker.server.stop(None)
        if server is not None:
            await asyncio.to_thread(server.close)


async def test_sim_worker_serves_every_name_and_counts_a_request_in_flight() -> None:
    port = free_port()
    host = sim_host(SimConfig("decode", "d0", decode_s_per_token=0.05), f"127.0.0.1:{port}")
    async with serving(host, port) as (worker, server):
        assert server is not None and server.endpoint == f"127.0.0.1:{port}"
        before = await asyncio.to_thread(scrape, server.endpoint)
        check_names(before, "decode")
        assert before["pdserve:worker_info"][1] == {
            "worker_id": "d0", "role": "decode", "model_name": "sim", "transport": "tcp",
            "version": before["pdserve:worker_info"][1]["version"]}
        assert value(before, "worker_ready") == 1
        assert value(before, "worker_inflight_requests") == 0
        client = WorkerClient(f"127.0.0.1:{worker.port}")
        assert (await client.health(5)).metrics_endpoint == server.endpoint
        request = PhaseRequest("r1", "decode", (1, 2, 3), SamplingSpec(max_tokens=40))
        stream = client.generate(request, 30)
        await anext(stream)  # running: 2 s of tokens left
        during = await asyncio.to_thread(scrape, server.endpoint)
        await stream.aclose()
        await client.close()
        assert value(during, "worker_inflight_requests") == 1
        await worker.state.start_drain()
        drained = await asyncio.to_thread(scrape, server.endpoint)
        assert value(drained, "worker_ready") == 0


async def test_engine_host_reports_its_connector_counters_after_a_transfer() -> None:
    """The prefill side's KV endpoint serves a pull; the host's /metrics shows the
    transfer, its bytes and time, and the lease it held, from the connector's status."""
    leases = LeaseTable()
    leases.add("r1", [1, 2], time.time() + 30)
    served, kv_port = start_transport("tcp", make_caches(1, torch.float32), leases)
    puller, _ = start_transport("tcp", make_caches(2, torch.float32), LeaseTable())
    config = EngineConfig(model_path="/m", served_model_name="m", role="prefill",
                          connector=ConnectorConfig(engine_id="p0", kv_port=kv_port))
    host = EngineHost(config, "p0", PrefillPolicy(release=lambda h: None),
                      lambda c, n: cast(Engine, _NoEngine(ConnectorStatus(c.connector))))
    host.start()
    port = free_port()
    try:
        async with serving(host, port) as (_, server):
            assert server is not None
            before = await asyncio.to_thread(scrape, server.endpoint)
            check_names(before, "prefill")
            assert value(before, "kv_leases_held") == 1
            assert value(before, "kv_pending_transfers") == 1
            nbytes = await asyncio.to_thread(
                puller.pull, PeerAddress("127.0.0.1", kv_port), "r1", [1, 2], [3, 4],
                time.monotonic() + 10)
            after = await asyncio.to_thread(scrape, server.endpoint)
    finally:
        puller.close()
        served.close()
    assert nbytes == sum(t[[1, 2]].nbytes for t in make_caches(1, torch.float32).values())
    assert value(after, "kv_transfers_completed_total") == \
        value(before, "kv_transfers_completed_total") + 1
    assert value(after, "kv_transfer_bytes_sent_total") == \
        value(before, "kv_transfer_bytes_sent_total") + nbytes
    assert value(after, "kv_transfer_seconds_total") > value(before, "kv_transfer_seconds_total")
    assert after["pdserve:worker_ready"][1] == {"model_name": "m", "role": "prefill",
                                                "transport": "tcp"}


async def test_every_kv_tier_and_pool_field_is_a_counter_of_its_value() -> None:
    """Each GetLoad ``kv_tier_*``/``kv_disk_*``/``kv_pool_*`` field is exported as a
    counter of its value, ``*_time_ns`` in seconds, with a help text naming its tier."""
    tiered = [f.name for f in fields(WorkerLoadReport)
              if f.name.startswith(("kv_tier_", "kv_disk_", "kv_pool_"))]
    counts: dict[str, Any] = {name: 1000 * (i + 1) for i, name in enumerate(tiered)}
    load = WorkerLoadReport(**counts)

    async def sampler() -> WorkerSample:
        return WorkerSample(True, load, "prefill")

    collector = WorkerCollector(WorkerHealth(True, "prefill", "p0", "m", transport="tcp"),
                                sampler, asyncio.get_running_loop())
    families = await asyncio.to_thread(lambda: list(collector.collect()))
    exported = {s.name: (f.type, f.documentation, s.value) for f in families for s in f.samples}
    expected = {}
    for name in tiered:
        seconds = name.endswith("_time_ns")
        metric = "pdserve:" + name.replace("_time_ns", "_seconds") + "_total"
        expected[metric] = getattr(load, name) * (1e-9 if seconds else 1)
    assert set(expected) == {f"pdserve:{name}_total" for name in TIER_COUNTERS}
    for metric, want in expected.items():
        kind, doc, got = exported[metric]
        assert kind == "counter" and got == pytest.approx(want), metric
        tier = {"tier": ("Host tier", "KV tiers"), "disk": ("Disk tier",),
                "pool": ("KV pool",)}[metric.split("_")[1]]
        assert doc.startswith(tier), (metric, doc)


class _NoEngine:
    """An engine that is up and serves nothing (these tests only read counters); its
    connector's counters come from its KV endpoint, as vLLM's do."""

    block_size, dtype, num_kv_blocks = 128, "float32", 64

    def __init__(self, status: ConnectorStatus) -> None:
        self._status = status

    def kv_status(self) -> dict[str, Any]:
        return self._status.read()

    def shutdown(self) -> None:
        return None


def _listening() -> set[int]:
    return {c.laddr.port for c in psutil.Process().net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}


async def test_metrics_port_0_listens_nowhere() -> None:
    host = sim_host(SimConfig("prefill", "p0"))
    before = _listening()
    async with serving(host, 0) as (worker, server):
        assert server is None
        assert _listening() - before == {worker.port}  # gRPC only
        assert host.health().metrics_endpoint == ""


def test_metrics_flags_and_listener() -> None:
    args = build_parser().parse_args(["decode", "--host", "0.0.0.0", "--metrics-port", "9100"])
    assert (args.metrics_port, args.metrics_host) == (9100, None)
    listener = MetricsListener.from_flags(None, 9100, "0.0.0.0", "10.0.0.7")
    assert (listener.host, listener.endpoint) == ("0.0.0.0", "10.0.0.7:9100")
    assert MetricsListener.from_flags("10.0.0.8", 9100, "0.0.0.0", "h").endpoint == \
        "10.0.0.8:9100"
    assert MetricsListener.from_flags(None, 0, "127.0.0.1", "127.0.0.1").endpoint == ""
    assert build_parser().parse_args(["sim-worker"]).metrics_port == 0  # off by default


def test_registration_carries_the_metrics_endpoint_and_old_ones_still_parse() -> None:
    info = WorkerInfo("d0", "decode", "127.0.0.1:5000", metrics_endpoint="127.0.0.1:9100")
    assert WorkerInfo.from_json(info.to_json()) == info
    old = json.dumps({"worker_id": "d0", "role": "decode", "grpc_endpoint": "h:1"})
    assert WorkerInfo.from_json(old).metrics_endpoint == ""


def test_up_plans_a_metrics_port_per_worker_unless_off(tmp_path: Path) -> None:
    model = ResolvedModel(Path("/m"), "m")
    on = plan(up_config(build_parser().parse_args(["up", "--simulated"]), model),
              tmp_path)
    targets = scrape_targets(on)
    assert list(targets) == ["router", "prefill-0", "decode-0"]
    for child in on[:-1]:
        port = child.argv[child.argv.index("--metrics-port") + 1]
        assert targets[child.name] == f"127.0.0.1:{port}"
    off = plan(up_config(build_parser().parse_args(
        ["up", "--simulated", "--no-worker-metrics"]), model), tmp_path)
    assert list(scrape_targets(off)) == ["router"]
    # Several router processes: each one's admin listener is a target of its own.
    several = plan(up_config(build_parser().parse_args(
        ["up", "--simulated", "--no-worker-metrics", "--router-processes", "2",
         "--admin-port", "9300"]), model), tmp_path)
    assert scrape_targets(several) == {"router-0": "127.0.0.1:9300",
                                       "router-1": "127.0.0.1:9301"}
    groups = file_sd(scrape_targets(several))
    assert {cast(dict[str, str], g["labels"])["component"] for g in groups} == {"router"}


def test_the_targets_file_is_written_through_a_fresh_file_never_a_planted_link(
        tmp_path: Path) -> None:
    """The file often goes in ``/tmp`` (docs/observability.md): its temporary name was
    fixed (``.<name>.tmp``), so a link planted there sent the write into another file."""
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (tmp_path / ".targets.json.tmp").symlink_to(victim)
    path = write_file_sd(tmp_path / "targets.json", {"router": "127.0.0.1:9300"})
    assert victim.read_text() == "untouched"
    assert json.loads(path.read_text()) == file_sd({"router": "127.0.0.1:9300"})
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # Prometheus may be another user
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        ".targets.json.tmp", "targets.json", "victim"]


def test_up_simulated_prints_and_writes_targets_that_answer(tmp_path: Path) -> None:
    sd_file = tmp_path / "targets.json"
    env = dict(os.environ, PDSERVE_LOG_LEVEL="WARNING")
    server = launch_up(["--simulated", "--port", str(free_port()), "--startup-timeout-s",
                        str(STARTUP_TIMEOUT_S), "--metrics-targets-file", str(sd_file)],
                       env, STARTUP_TIMEOUT_S, log_path=tmp_path / "up.log")
    try:
        targets = server.metrics_targets
        assert list(targets) == ["router", "prefill-0", "decode-0"], targets
        for name, url in targets.items():
            reply = httpx.get(url, timeout=10)
            assert reply.status_code == 200, name
            if name != "router":
                families = {f.name for f in text_string_to_metric_families(reply.text)}
                assert {"pdserve:worker_ready", "pdserve:kv_loads"} <= families, name
        view = httpx.get(server.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
        shown = {w["id"]: f"http://{w['metrics_endpoint']}/metrics" for w in view["workers"]}
        assert shown == {k: v for k, v in targets.items() if k != "router"}
        groups = json.loads(sd_file.read_text())
        assert {g["labels"]["instance_name"]: g["targets"][0] for g in groups} == {
            k: v.removeprefix("http://").removesuffix("/metrics") for k, v in targets.items()}
    finally:
        stop_up(server.proc)
