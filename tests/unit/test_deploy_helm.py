"""The Helm chart (deploy/helm/pdserve), offline: lint and render through the Helm SDK
(helm-python-sdk), every rendered manifest validated strictly against the Kubernetes
schemas (kubernetes-validate), and the values schema refusing bad values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from pdserve.cli.flags import FLAGS
from pdserve.cli.main import build_parser
from pdserve.core.logs import LOG_FORMATS
from pdserve.kv_transfer.base import transport_names
from pdserve.router.dispatch.disagg import DISAGG_MODES
from pdserve.router.dispatch.placement import PLACEMENTS
from pdserve.router.dispatch.planner import PLANNER_MODES

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
KUBE_VERSION = "1.33.0"  # a version kubernetes-validate ships schemas for
# Kinds that come from CRDs (no schema in kubernetes-validate): checked by hand below.
CRD_KINDS = {"ServiceMonitor", "ScaledObject"}

GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
EVERYTHING = {  # every optional part on
    "router": {"autoscaling": {"enabled": True, "maxReplicas": 3}, "planner": "export"},
    "keda": {"enabled": True},
    "etcd": {"persistence": {"enabled": True, "storageClassName": "fast"}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "grafanaDashboard": {"enabled": True, "json": '{"title": "pdserve"}'}},
    "model": {"path": "/models/tiny", "servedModelName": "tiny"},
    "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "imagePullSecrets": [{"name": "registry"}],
}
VALUES = {"default": None, "gpu": GPU_VALUES, "everything": EVERYTHING}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = chart.render(values, name="pd", namespace="serving", is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def env_of(deployment: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(deployment)["env"]}


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_chart_lints_clean(values: dict[str, Any] | None) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warning, error
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values", VALUES.values(), ids=VALUES.keys())
def test_every_rendered_manifest_is_valid_kubernetes(chart: Any,
                                                     values: dict[str, Any] | None) -> None:
    docs = render(chart, values)
    skipped = set()
    for doc in docs:
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            skipped.add(doc["kind"])
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']}: {exc.message} "
                        f"at {list(exc.path)}")
    assert skipped <= CRD_KINDS, f"no schema for {skipped - CRD_KINDS}"
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "Service", "StatefulSet", "Secret", "PodDisruptionBudget"} <= kinds
    if values is EVERYTHING:
        assert {"HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap", "ScaledObject"} <= kinds


def test_service_monitor_scrapes_the_router_admin_and_worker_metrics_ports(chart: Any) -> None:
    """The CRD kind kubernetes-validate cannot check: its endpoints name ports that the
    selected Services have, and every pdserve component's Service is selected."""
    docs = render(chart, EVERYTHING)
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prom"
    selector = monitor["spec"]["selector"]
    (expr,) = selector["matchExpressions"]
    selected = [s for s in by_kind(docs, "Service").values()
                if all(s["metadata"]["labels"].get(k) == v
                       for k, v in selector["matchLabels"].items())
                and s["metadata"]["labels"]["app.kubernetes.io/component"] in expr["values"]]
    components = {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected}
    assert components == {"router", "prefill", "decode"}
    ports = {p["name"] for s in selected for p in s["spec"]["ports"]}
    endpoints = monitor["spec"]["endpoints"]
    assert {e["port"] for e in endpoints} == {"admin", "metrics"} <= ports
    assert all(e["path"] == "/metrics" for e in endpoints)


def test_workers_probe_grpc_health_and_advertise_their_pod_ip(chart: Any) -> None:
    deployments = by_kind(render(chart), "Deployment")
    for role in ("prefill", "decode"):
        worker = deployments[f"pd-pdserve-{role}"]
        main = container(worker)
        assert main["args"] == [role]
        grpc_port = next(p["containerPort"] for p in main["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert main[probe]["grpc"] == {"port": grpc_port}
        env = env_of(worker)
        assert env["PDSERVE_ADVERTISE_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        assert env["PDSERVE_PORT"] == str(grpc_port)
        assert env["PDSERVE_ETCD"] == "http://pd-pdserve-etcd:2379"
        assert "nvidia.com/gpu" not in main["resources"].get("limits", {})
    router = container(deployments["pd-pdserve-router"])
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "admin"}


def test_gpu_values_give_each_worker_a_gpu(chart: Any) -> None:
    deployments = by_kind(render(chart, GPU_VALUES), "Deployment")
    for role in ("prefill", "decode"):
        worker = deployments[f"pd-pdserve-{role}"]
        assert container(worker)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert container(worker)["image"] == "pdserve:gpu"
    assert "nvidia.com/gpu" not in container(deployments["pd-pdserve-router"])["resources"].get(
        "limits", {})


def test_every_pdserve_variable_is_a_flag_the_process_reads(chart: Any) -> None:
    """A misspelt PDSERVE_* variable would be ignored silently: each must be a flag's of
    the subcommand its container runs."""
    parser = build_parser()
    subcommands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    for values in VALUES.values():
        for deployment in by_kind(render(chart, values), "Deployment").values():
            (command,) = container(deployment)["args"]
            known = {a.option_strings[0][2:] for a in subcommands[command]._actions
                     if a.option_strings and a.option_strings[0].startswith("--")}
            accepted = {FLAGS[name].env for name in known if name in FLAGS}
            used = {name for name in env_of(deployment) if name.startswith("PDSERVE_")}
            assert used <= accepted, (command, used - accepted)


def test_secrets_are_generated_or_taken_from_existing_ones(chart: Any) -> None:
    generated = render(chart)
    secrets = by_kind(generated, "Secret")
    assert set(secrets) == {"pd-pdserve-cluster-secret", "pd-pdserve-api-key"}
    assert len(secrets["pd-pdserve-cluster-secret"]["data"]["cluster-secret"]) >= 32
    router = by_kind(generated, "Deployment")["pd-pdserve-router"]
    assert env_of(router)["PDSERVE_API_KEY_FILE"] == "/etc/pdserve/api-key/api-key"

    own = render(chart, {"clusterSecret": {"existingSecret": "ours"},
                         "apiKey": {"existingSecret": "keys", "secretKey": "k"}})
    assert not by_kind(own, "Secret")
    deployments = by_kind(own, "Deployment")
    for deployment in deployments.values():
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["cluster-secret"]["secret"]["secretName"] == "ours"
    assert env_of(deployments["pd-pdserve-router"])["PDSERVE_API_KEY_FILE"].endswith("/k")

    open_router = by_kind(render(chart, {"apiKey": {"create": False}}), "Deployment")
    assert "PDSERVE_API_KEY_FILE" not in env_of(open_router["pd-pdserve-router"])


def test_external_etcd_replaces_the_statefulset(chart: Any) -> None:
    docs = render(chart, {"etcd": {"enabled": False, "externalEndpoint": "http://etcd.db:2379"}})
    assert not by_kind(docs, "StatefulSet")
    for deployment in by_kind(docs, "Deployment").values():
        assert env_of(deployment)["PDSERVE_ETCD"] == "http://etcd.db:2379"
    with pytest.raises(helm.HelmRenderError, match="externalEndpoint"):
        render(chart, {"etcd": {"enabled": False}})


def test_the_dashboard_configmap_needs_the_dashboard_file(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match="--set-file"):
        render(chart, {"monitoring": {"grafanaDashboard": {"enabled": True}}})
    (dashboard,) = by_kind(render(chart, EVERYTHING), "ConfigMap").values()
    assert json.loads(dashboard["data"]["pdserve.json"]) == {"title": "pdserve"}
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"


BAD_VALUES = {
    "wrong type": {"router": {"port": "8000"}},
    "negative replicas": {"prefill": {"replicas": -1}},
    "negative decode replicas": {"decode": {"replicas": -2}},
    "unknown transport": {"decode": {"transport": "nccl"}},
    "unknown key": {"rotuer": {"replicas": 2}},
    "gpus as text": {"decode": {"gpus": "one"}},
    "unknown planner mode": {"router": {"planner": "auto"}},
    # KEDA scales the workers: a planner that also flips their roles would fight it.
    "keda with a planner that flips roles": {"keda": {"enabled": True},
                                             "router": {"planner": "on"}},
    "keda with the planner off": {"keda": {"enabled": True}},
    "keda scaling decode to zero": {"keda": {"decode": {"minReplicas": 0}}},
    "no router process": {"router": {"processes": 0}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_the_values_schema_refuses_bad_values(chart: Any, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render(chart, values)
    report = helm.lint(CHART, values, strict=True)
    assert any(m["severity"] == 3 and "schema" in m["error"] for m in report["messages"])


def test_zero_replicas_is_allowed(chart: Any) -> None:
    docs = render(chart, {"prefill": {"replicas": 0}})
    assert by_kind(docs, "Deployment")["pd-pdserve-prefill"]["spec"]["replicas"] == 0


def test_schema_enums_are_pdserve_own_choices() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    props = schema["properties"]
    router = props["router"]["properties"]
    assert set(router["placement"]["enum"]) == set(PLACEMENTS)
    assert set(router["disagg"]["enum"]) == set(DISAGG_MODES)
    assert set(router["planner"]["enum"]) == set(PLANNER_MODES)
    assert set(router["tenantIsolation"]["enum"]) == set(FLAGS["tenant-isolation"].choices or ())
    assert set(props["logFormat"]["enum"]) == set(LOG_FORMATS)
    assert set(props["logLevel"]["enum"]) == set(FLAGS["log-level"].choices or ())
    for role in ("prefill", "decode"):
        worker = props[role]["properties"]
        assert set(worker["transport"]["enum"]) == set(transport_names())
        assert set(worker["dtype"]["enum"]) == set(FLAGS["dtype"].choices or ())


def test_tenant_isolation_reaches_the_router(chart: Any) -> None:
    router = "pd-pdserve-router"
    assert env_of(by_kind(render(chart), "Deployment")[router])[
        "PDSERVE_TENANT_ISOLATION"] == "off"
    docs = render(chart, {"router": {"tenantIsolation": "key"}})
    assert env_of(by_kind(docs, "Deployment")[router])["PDSERVE_TENANT_ISOLATION"] == "key"


def test_every_router_replica_is_a_planner_candidate_on_etcd(chart: Any) -> None:
    """The chart's membership is always etcd, so several router replicas (or an HPA)
    with the planner on elect one leader: each replica runs as a candidate."""
    for router_values in ({"replicas": 3, "planner": "on"},
                          {"autoscaling": {"enabled": True}, "planner": "on"}):
        docs = render(chart, {"router": router_values})
        env = env_of(by_kind(docs, "Deployment")["pd-pdserve-router"])
        assert env["PDSERVE_PLANNER"] == "on"
        assert env["PDSERVE_ETCD"] == "http://pd-pdserve-etcd:2379"
        assert not by_kind(docs, "ScaledObject")  # keda is off by default


def test_keda_scales_each_worker_deployment_from_the_leaders_desired_replicas(
        chart: Any) -> None:
    """KEDA's CRD is not in kubernetes-validate's schemas: its structure by hand."""
    values = {"router": {"planner": "export"},
              "keda": {"enabled": True, "prometheus": {"serverAddress": "http://prom:9090"},
                       "prefill": {"minReplicas": 0, "maxReplicas": 3},
                       "decode": {"minReplicas": 1, "maxReplicas": 5}}}
    docs = render(chart, values)
    objects = by_kind(docs, "ScaledObject")
    deployments = by_kind(docs, "Deployment")
    assert set(objects) == {"pd-pdserve-prefill", "pd-pdserve-decode"}
    for role, (low, high) in (("prefill", (0, 3)), ("decode", (1, 5))):
        scaled = objects[f"pd-pdserve-{role}"]
        assert scaled["apiVersion"] == "keda.sh/v1alpha1"
        spec = scaled["spec"]
        target = spec["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == ("apps/v1", "Deployment")
        assert target["name"] in deployments
        assert container(deployments[target["name"]])["args"] == [role]
        assert "replicas" not in deployments[target["name"]]["spec"]  # KEDA owns it
        assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (low, high)
        (trigger,) = spec["triggers"]
        assert trigger["type"] == "prometheus"
        assert trigger["metricType"] == "AverageValue"
        meta = trigger["metadata"]
        assert meta["serverAddress"] == "http://prom:9090"
        assert meta["threshold"] == "1"  # one pod per unit of the value
        assert meta["ignoreNullValues"] == "false"  # no leader: no change
        query = meta["query"]
        assert f'pdserve:planner_desired_replicas{{role="{role}",' in query
        assert "pdserve:planner_leader{" in query and "== 1" in query
        assert 'namespace="serving",service="pd-pdserve-router"' in query
    assert env_of(deployments["pd-pdserve-router"])["PDSERVE_PLANNER"] == "export"
    own = render(chart, {**values, "keda": {**values["keda"], "prometheus": {
        "serverAddress": "http://prom:9090", "metricSelector": 'job="routers"'}}})
    query = by_kind(own, "ScaledObject")["pd-pdserve-decode"]["spec"]["triggers"][0][
        "metadata"]["query"]
    assert 'role="decode",job="routers"}' in query and "namespace" not in query


def test_each_router_process_has_an_admin_port_the_service_monitor_scrapes(chart: Any) -> None:
    """router.processes: PDSERVE_PROCESSES, and process i's admin listener (adminPort + i)
    as a named port of the pod and the Service, each an endpoint of the ServiceMonitor."""
    docs = render(chart, {**EVERYTHING, "router": {**EVERYTHING.get("router", {}),
                                                   "processes": 3, "adminPort": 8101}})
    (router,) = [d for n, d in by_kind(docs, "Deployment").items() if n.endswith("-router")]
    assert env_of(router)["PDSERVE_PROCESSES"] == "3"
    assert env_of(router)["PDSERVE_ADMIN_PORT"] == "8101"
    ports = {p["name"]: p["containerPort"] for p in container(router)["ports"]}
    assert {k: v for k, v in ports.items() if k.startswith("admin")} == {
        "admin": 8101, "admin-1": 8102, "admin-2": 8103}
    (service,) = [d for n, d in by_kind(docs, "Service").items() if n.endswith("-router")]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]
            if p["name"].startswith("admin")} == {"admin": 8101, "admin-1": 8102,
                                                  "admin-2": 8103}
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {
        "admin", "admin-1", "admin-2", "metrics"}
    one = render(chart, EVERYTHING)
    (router,) = [d for n, d in by_kind(one, "Deployment").items() if n.endswith("-router")]
    assert env_of(router)["PDSERVE_PROCESSES"] == "1"
    assert [p["name"] for p in container(router)["ports"]] == ["http", "admin"]
