"""What an operator's Prometheus and orchestrator see of the real workers of
``pdserve up`` (the session's tcp cluster, KV pushed): every worker's ``/metrics``
parses with prometheus-client's parser and holds its engine's ``vllm:*`` metrics and
its connector's ``pdserve:*`` counters, which move with the transfers a request makes
and agree with ``GetLoad``; every worker answers the standard gRPC health check."""

from __future__ import annotations

from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from integration.pd_cases import LONG, MODEL, NUM_LAYERS
from pdserve_testing import Server, dashboard_metric_names, wait_until
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration

Samples = dict[str, tuple[str, dict[str, str], float]]
VLLM = ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total")
PDSERVE = ("kv_transfers_completed_total", "kv_transfers_failed_total",
           "kv_transfer_bytes_sent_total", "kv_transfer_bytes_received_total",
           "kv_transfer_seconds_total", "kv_loads_total", "kv_load_seconds_total",
           "kv_push_loads_total", "kv_push_fallbacks_total", "kv_layers_pushed_total",
           "kv_pushes_failed_total", "kv_leases_held", "kv_leases_expired_total",
           "kv_pending_transfers", "kv_push_inbox_bytes", "worker_inflight_requests",
           "worker_ready", "worker_info")


def scrape(url: str) -> Samples:
    """sample name -> (family type, labels, value), summed over vLLM's per-engine
    series; every family parsed."""
    reply = httpx.get(url, timeout=10)
    reply.raise_for_status()
    out: Samples = {}
    for family in text_string_to_metric_families(reply.text):
        for s in family.samples:
            total = out[s.name][2] + s.value if s.name in out else s.value
            out[s.name] = (family.type, s.labels, total)
    return out


def worker_targets(server: Server) -> dict[str, str]:
    """Worker id -> /metrics URL, as the router's /workers shows them; up printed the same."""
    view = httpx.get(server.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
    shown = {w["id"]: f"http://{w['metrics_endpoint']}/metrics" for w in view["workers"]}
    assert shown == {k: v for k, v in server.metrics_targets.items() if k != "router"}
    return shown


def test_every_worker_serves_vllm_and_connector_metrics_that_move_with_transfers(
    pd_server: Server,
) -> None:
    targets = worker_targets(pd_server)
    assert set(targets) == {"prefill-0", "decode-0"}
    assert httpx.get(pd_server.metrics_targets["router"], timeout=5).status_code == 200
    before = {name: scrape(url) for name, url in targets.items()}
    p0, d0 = pd_server.load("prefill"), pd_server.load("decode")
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)
    for i in range(2):  # long prompts: prefilled remotely, KV pushed to decode
        client.completions.create(model=MODEL, prompt=f"metrics {i}: " + LONG, max_tokens=3,
                                  temperature=0)

    def settled() -> bool:
        """Both loaded, and every layer's push acked: the prefill counts a layer when
        its ack arrives, which can be after the decode took the push."""
        p, d = pd_server.load("prefill"), pd_server.load("decode")
        return (d.kv_loads - d0.kv_loads >= 2 and p.num_pending_transfers == 0
                and p.kv_layers_pushed - p0.kv_layers_pushed >= 2 * NUM_LAYERS)
    assert wait_until(settled, timeout_s=30)
    after = {name: scrape(url) for name, url in targets.items()}
    for name, samples in after.items():
        role = name.split("-")[0]
        for metric in VLLM:
            assert metric in samples, (name, metric)
            assert samples[metric][1]["model_name"] == MODEL
        for metric in PDSERVE:
            kind, labels, _ = samples[f"pdserve:{metric}"]
            assert kind == ("counter" if metric.endswith("_total") else "gauge"), metric
            assert labels["role"] == role and labels["transport"] == "tcp"
            assert labels["model_name"] == MODEL
            assert ("worker_id" in labels) == (metric == "worker_info"), metric
        assert samples["pdserve:worker_info"][1]["worker_id"] == name
        assert samples["pdserve:worker_ready"][2] == 1

    def grew(name: str, metric: str) -> float:
        return after[name][metric][2] - before[name][metric][2]

    assert grew("prefill-0", "vllm:prompt_tokens_total") > 0
    assert grew("decode-0", "vllm:prompt_tokens_total") > 0
    assert grew("prefill-0", "pdserve:kv_layers_pushed_total") >= 2 * NUM_LAYERS
    assert grew("decode-0", "pdserve:kv_loads_total") >= 2
    assert grew("decode-0", "pdserve:kv_push_loads_total") >= 2
    assert grew("decode-0", "pdserve:kv_transfer_bytes_received_total") > 0
    assert after["decode-0"]["pdserve:kv_push_fallbacks_total"][2] == \
        before["decode-0"]["pdserve:kv_push_fallbacks_total"][2]
    # The same source as GetLoad: the connector's counters agree once nothing moves (a
    # decode counts a pushed layer's bytes just after it acks it: compare until then).
    def agree() -> bool:
        scraped, d = scrape(targets["decode-0"]), pd_server.load("decode")
        return (scraped["pdserve:kv_loads_total"][2] == d.kv_loads
                and scraped["pdserve:kv_transfer_bytes_received_total"][2]
                == d.kv_bytes_received)
    assert wait_until(agree, timeout_s=10)


def test_every_worker_answers_the_standard_grpc_health_check(pd_server: Server) -> None:
    """What a Kubernetes gRPC probe (or grpc_health_probe) asks: overall health, no
    cluster secret (the standard service stays open under it); over TLS when the
    cluster runs it (``pdserve health`` with the TLS files, as the chart's probe)."""
    view = httpx.get(pd_server.base_url.removesuffix("/v1") + "/workers", timeout=5).json()
    endpoints = {w["id"]: w["endpoint"] for w in view["workers"]}
    assert set(endpoints) == {"prefill-0", "decode-0"}
    for name, endpoint in endpoints.items():
        tls = pd_server.tls
        with (grpc.insecure_channel(endpoint) if tls is None
              else grpc.secure_channel(endpoint, tls.channel_credentials())) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in ("", "pdserve.v1.WorkerService"):
                # grpc_health's stubs leave out the stub's methods
                reply = stub.Check(  # type: ignore[attr-defined]
                    health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING, (name, service)


DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pdserve.json"


def test_every_metric_the_dashboard_queries_is_served_by_the_live_cluster(
    pd_server: Server,
) -> None:
    """deploy/grafana/pdserve.json's queries all have data on a real ``pdserve up``: every
    metric name they use is in the router's or a worker's /metrics after a few requests
    (a streamed chat one, a long prompt handed over, a client error), each scrape parsed
    by prometheus-client."""
    client = openai.OpenAI(base_url=pd_server.base_url, api_key="none", timeout=120)
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=4,
        temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    client.completions.create(model=MODEL, prompt="dashboard: " + LONG, max_tokens=2,
                              temperature=0)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    served: set[str] = set()
    for url in pd_server.metrics_targets.values():
        served |= set(scrape(url))
    wanted = dashboard_metric_names(DASHBOARD)
    assert len(wanted) >= 20
    assert {n.split(":")[0] for n in wanted} == {"pdserve", "vllm"}
    assert wanted <= served, sorted(wanted - served)
