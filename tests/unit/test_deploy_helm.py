"""The Helm chart (deploy/helm/pdserve), offline: lint and render through the Helm SDK
(helm-python-sdk), every rendered manifest validated strictly against the Kubernetes
schemas (kubernetes-validate), and the values schema refusing bad values."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from unit.etcd_from_env import localize, running_etcd, tls_refusals

from pdserve.cli.flags import FLAGS
from pdserve.cli.health import HealthTarget
from pdserve.cli.parser import build_parser
from pdserve.core.certs import make_test_ca
from pdserve.core.logs import LOG_FORMATS
from pdserve.kv_transfer.base import transport_names
from pdserve.router.dispatch.policies.disagg import DISAGG_MODES
from pdserve.router.dispatch.policies.placement import PLACEMENTS
from pdserve.router.dispatch.policies.planner import PLANNER_MODES

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "pdserve"
KUBE_VERSION = "1.33.0"  # a version kubernetes-validate ships schemas for
# Kinds that come from CRDs (no schema in kubernetes-validate): checked by hand below.
CRD_KINDS = {"ServiceMonitor", "ScaledObject", "Certificate"}

GPU_VALUES = yaml.safe_load((CHART / "values-gpu.yaml").read_text())
EVERYTHING: dict[str, Any] = {  # every optional part on
    "router": {"autoscaling": {"enabled": True, "maxReplicas": 3}, "planner": "export"},
    "keda": {"enabled": True},
    "etcd": {"persistence": {"enabled": True, "storageClassName": "fast"}},
    "monitoring": {"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}},
                   "grafanaDashboard": {"enabled": True, "json": '{"title": "pdserve"}'}},
    "model": {"path": "/models/tiny", "servedModelName": "tiny"},
    "extraVolumes": [{"name": "models", "persistentVolumeClaim": {"claimName": "models"}}],
    "extraVolumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}],
    "imagePullSecrets": [{"name": "registry"}],
    "lora": {"enabled": True, "modules": [{"name": "sql", "path": "/models/sql"},
                                          {"name": "chat", "path": "/models/chat"}],
             "maxLoras": 2, "maxLoraRank": 8},
    "tls": {"enabled": True, "certManager": {"enabled": True,
                                             "issuerRef": {"name": "pdserve-ca"}}},
}
VALUES = {"default": None, "gpu": GPU_VALUES, "everything": EVERYTHING}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    rendered = chart.render(values, name="pd", namespace="serving", is_install=True)
    docs: list[dict[str, Any]] = []
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
        assert {"HorizontalPodAutoscaler", "ServiceMonitor", "ConfigMap", "ScaledObject",
                "Certificate"} <= kinds


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
    # The router's admin plane is scraped with the admin key (the router's own Secret);
    # the workers' metrics ports need none.
    secrets = by_kind(docs, "Secret")
    for endpoint in endpoints:
        if endpoint["port"] == "admin":
            auth = endpoint["authorization"]
            assert auth["type"] == "Bearer"
            assert auth["credentials"]["key"] in secrets[auth["credentials"]["name"]]["data"]
        else:
            assert "authorization" not in endpoint


def test_without_an_admin_key_the_admin_plane_is_the_pods_own(chart: Any) -> None:
    """adminKey off: no key file, no scrape of the admin port (loopback only), and the
    liveness probe asks from inside the pod."""
    docs = render(chart, {**EVERYTHING, "adminKey": {"create": False}})
    router = by_kind(docs, "Deployment")["pd-pdserve-router"]
    assert "PDSERVE_ADMIN_KEY_FILE" not in env_of(router)
    assert "pd-pdserve-admin-key" not in by_kind(docs, "Secret")
    probe = container(router)["livenessProbe"]
    assert probe["exec"]["command"][:2] == ["pdserve", "health"]
    assert "http://127.0.0.1:8001/health" in probe["exec"]["command"]
    (monitor,) = by_kind(docs, "ServiceMonitor").values()
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics"}
    keyed = by_kind(render(chart, EVERYTHING), "Deployment")["pd-pdserve-router"]
    assert container(keyed)["livenessProbe"]["httpGet"]["port"] == "admin"


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
    assert parser._subparsers is not None
    subcommands = cast(dict[str, argparse.ArgumentParser],
                       parser._subparsers._group_actions[0].choices)
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
    assert set(secrets) == {"pd-pdserve-cluster-secret", "pd-pdserve-api-key",
                            "pd-pdserve-admin-key"}
    assert len(secrets["pd-pdserve-cluster-secret"]["data"]["cluster-secret"]) >= 32
    router = by_kind(generated, "Deployment")["pd-pdserve-router"]
    assert env_of(router)["PDSERVE_API_KEY_FILE"] == "/etc/pdserve/api-key/api-key"
    assert env_of(router)["PDSERVE_ADMIN_KEY_FILE"] == "/etc/pdserve/admin-key/admin-key"
    assert secrets["pd-pdserve-admin-key"]["data"]["admin-key"] != secrets[
        "pd-pdserve-api-key"]["data"]["api-key"]

    own = render(chart, {"clusterSecret": {"existingSecret": "ours"},
                         "apiKey": {"existingSecret": "keys", "secretKey": "k"},
                         "adminKey": {"existingSecret": "ops", "secretKey": "a"}})
    assert not by_kind(own, "Secret")
    deployments = by_kind(own, "Deployment")
    for deployment in deployments.values():
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes["cluster-secret"]["secret"]["secretName"] == "ours"
    assert env_of(deployments["pd-pdserve-router"])["PDSERVE_API_KEY_FILE"].endswith("/k")
    assert env_of(deployments["pd-pdserve-router"])["PDSERVE_ADMIN_KEY_FILE"].endswith("/a")
    volumes = {v["name"]: v for v in
               deployments["pd-pdserve-router"]["spec"]["template"]["spec"]["volumes"]}
    assert volumes["admin-key"]["secret"]["secretName"] == "ops"

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
    "cert-manager without an issuer": {"tls": {"enabled": True,
                                               "certManager": {"enabled": True}}},
    "an ECDSA key of an RSA size": {"tls": {"certManager": {"privateKey": {
        "algorithm": "ECDSA", "size": 2048}}}},
    "an unknown tls key": {"tls": {"enable": True}},
    "tls.require as text": {"tls": {"require": "yes"}},
    "an admin key with no secret key": {"adminKey": {"secretKey": ""}},
    "an unknown adminKey field": {"adminKey": {"key": "adm-inline-key"}},
    "adminKey.create as text": {"adminKey": {"create": "no"}},
    "a LoRA rank vLLM refuses": {"lora": {"maxLoraRank": 12}},
    "a LoRA module without a path": {"lora": {"modules": [{"name": "sql"}]}},
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


def test_lora_values_reach_every_worker_as_its_own_flags(chart: Any) -> None:
    """The workers' environment parses as ``pdserve decode`` would: both modules, the
    limits; off by default (no LoRA variable at all)."""
    worker = "pd-pdserve-decode"
    assert not {k for k in env_of(by_kind(render(chart), "Deployment")[worker])
                if "LORA" in k}
    env = env_of(by_kind(render(chart, EVERYTHING), "Deployment")[worker])
    lora = {k: v for k, v in env.items() if "LORA" in k}
    args = build_parser().parse_args(
        ["decode", *(f"--{k[len('PDSERVE_'):].lower().replace('_', '-')}={v}"
                     for k, v in lora.items() if k != "PDSERVE_ENABLE_LORA"),
         "--enable-lora"])
    assert env["PDSERVE_ENABLE_LORA"] == "true"
    assert [(m.name, m.path) for m in args.lora_modules] == [
        ("sql", "/models/sql"), ("chat", "/models/chat")]
    assert (args.max_loras, args.max_lora_rank) == (2, 8)


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
    values: dict[str, Any] = {
        "router": {"planner": "export"},
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


# tls: one certificate (cert-manager's, or an existing Secret) for every pod; mutual TLS on
# gRPC, KV and etcd. The Certificate is a CRD's kind: its fields are checked by hand here.
CERT_MANAGER: dict[str, Any] = {"tls": {"enabled": True, "certManager": {
    "enabled": True, "issuerRef": {"name": "pdserve-ca", "kind": "ClusterIssuer"}}}}
PDSERVE_DEPLOYMENTS = ("pd-pdserve-router", "pd-pdserve-prefill", "pd-pdserve-decode")
TLS_ENV = {"PDSERVE_TLS_CERT": "tls.crt", "PDSERVE_TLS_KEY": "tls.key", "PDSERVE_TLS_CA": "ca.crt"}


def valid_for(certificate: dict[str, Any], host: str) -> bool:
    """Whether the Certificate names ``host`` as TLS clients check it (RFC 6125): an IP
    address exactly, a DNS name exactly or by a wildcard for its whole leftmost label."""
    spec = certificate["spec"]
    if host in spec.get("ipAddresses", []):
        return True
    label, _, parent = host.partition(".")
    return host in spec["dnsNames"] or bool(label and parent
                                            and f"*.{parent}" in spec["dnsNames"])


def advertised_host(worker: dict[str, Any], pod_ip: str, tmp_path: Path) -> str:
    """The PDSERVE_ADVERTISE_HOST the worker container's command hands pdserve, run by the
    local /bin/sh with a stand-in ``pdserve`` (which prints it, then its arguments)."""
    main = container(worker)
    assert not any("$(" in part for part in main["command"])  # kubelet would expand it
    fake = tmp_path / "pdserve"
    fake.write_text('#!/bin/sh\nprintf "%s %s" "$PDSERVE_ADVERTISE_HOST" "$*"\n')
    fake.chmod(0o755)
    out = subprocess.run([*main["command"], *main["args"]], capture_output=True, text=True,
                         env={"PATH": f"{tmp_path}:/usr/bin:/bin", "POD_IP": pod_ip},
                         timeout=10, check=True).stdout
    host, _, args = out.partition(" ")
    assert args.split() == main["args"]
    return host


def mounted_secret(deployment_or_set: dict[str, Any], path: str) -> str:
    """The Secret whose files the pod sees under ``path`` (read-only)."""
    pod = deployment_or_set["spec"]["template"]["spec"]
    (main,) = pod["containers"]
    (mount,) = [m for m in main["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    assert mount.get("readOnly") is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    return str(volume["secret"]["secretName"])


def etcd_env(docs: list[dict[str, Any]]) -> dict[str, str]:
    """The chart etcd container's variables, $(POD_NAME) expanded as kubelet does."""
    (etcd,) = by_kind(docs, "StatefulSet").values()
    return {e["name"]: e["value"].replace("$(POD_NAME)", "pd-pdserve-etcd-0")
            for e in container(etcd)["env"] if "value" in e}


def test_tls_certificate_names_every_host_the_pods_dial(chart: Any, tmp_path: Path) -> None:
    docs = render(chart, CERT_MANAGER)
    (cert,) = by_kind(docs, "Certificate").values()
    assert cert["apiVersion"] == "cert-manager.io/v1"
    spec = cert["spec"]
    assert spec["secretName"] == "pd-pdserve-tls"
    assert {"server auth", "client auth"} <= set(spec["usages"])
    assert spec["issuerRef"] == {"name": "pdserve-ca", "kind": "ClusterIssuer",
                                 "group": "cert-manager.io"}
    assert spec["privateKey"] == {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"}
    deployments, services = by_kind(docs, "Deployment"), by_kind(docs, "Service")
    for role in ("prefill", "decode"):
        worker = deployments[f"pd-pdserve-{role}"]
        assert "PDSERVE_ADVERTISE_HOST" not in env_of(worker)  # the command sets it
        for pod_ip in ("10.1.2.3", "fd00::2:1"):
            host = advertised_host(worker, pod_ip, tmp_path)
            dashed = pod_ip.replace(".", "-").replace(":", "-")
            assert host == f"{dashed}.pd-pdserve-{role}.serving.svc.cluster.local"
            assert valid_for(cert, host), host
        # ... a name that resolves while the worker loads and while it drains
        assert services[f"pd-pdserve-{role}"]["spec"]["publishNotReadyAddresses"] is True
    for name in PDSERVE_DEPLOYMENTS:  # etcd, as every process dials it
        etcd = urlsplit(env_of(deployments[name])["PDSERVE_ETCD"])
        assert etcd.scheme == "https" and valid_for(cert, str(etcd.hostname))
    for var in ("ETCD_ADVERTISE_CLIENT_URLS", "ETCD_INITIAL_ADVERTISE_PEER_URLS"):
        assert valid_for(cert, str(urlsplit(etcd_env(docs)[var]).hostname))
    assert valid_for(cert, "127.0.0.1")  # the probes, inside each pod
    assert not valid_for(cert, "10-1-2-3.other.serving.svc.cluster.local")
    assert not valid_for(cert, "a.10-1-2-3.pd-pdserve-prefill.serving.svc.cluster.local")
    own = render(chart, {"tls": {**CERT_MANAGER["tls"], "clusterDomain": "corp.internal",
                                 "certManager": {**CERT_MANAGER["tls"]["certManager"],
                                                 "extraDnsNames": ["etcd.db.corp"]}}})
    (cert,) = by_kind(own, "Certificate").values()
    worker = by_kind(own, "Deployment")["pd-pdserve-decode"]
    host = advertised_host(worker, "10.1.2.3", tmp_path)
    assert host.endswith(".svc.corp.internal") and valid_for(cert, host)
    assert valid_for(cert, "etcd.db.corp")


def test_tls_gives_every_pdserve_container_the_files_and_require_tls(chart: Any) -> None:
    docs = render(chart, CERT_MANAGER)
    deployments = by_kind(docs, "Deployment")
    for name in PDSERVE_DEPLOYMENTS:
        env = env_of(deployments[name])
        assert env["PDSERVE_REQUIRE_TLS"] == "true"
        for var, key in TLS_ENV.items():
            assert env[var] == f"/etc/pdserve/tls/{key}"
            assert mounted_secret(deployments[name], env[var]) == "pd-pdserve-tls"
    # The router's client and admin ports stay plaintext HTTP, probed as before.
    router = container(deployments["pd-pdserve-router"])
    assert router["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    relaxed = render(chart, {"tls": {**CERT_MANAGER["tls"], "require": False}})
    for deployment in by_kind(relaxed, "Deployment").values():
        assert env_of(deployment)["PDSERVE_REQUIRE_TLS"] == "false"


def test_tls_workers_are_probed_by_pdserve_health_with_their_files(chart: Any) -> None:
    """kubelet's gRPC probe cannot present a client certificate: `pdserve health` asks,
    in the container (its PDSERVE_TLS_* files), at 127.0.0.1 (which the certificate names)."""
    parser = build_parser()
    for role in ("prefill", "decode"):
        worker = by_kind(render(chart, CERT_MANAGER), "Deployment")[f"pd-pdserve-{role}"]
        main = container(worker)
        grpc_port = next(p["containerPort"] for p in main["ports"] if p["name"] == "grpc")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert "grpc" not in main[probe]
            command = main[probe]["exec"]["command"]
            assert command[0] == "pdserve"
            args = parser.parse_args(command[1:])
            assert args.command == "health"
            assert args.healthcheck == HealthTarget("grpc", "127.0.0.1", grpc_port)
            assert args.health_timeout_s < main[probe]["timeoutSeconds"]


def test_tls_worker_probes_read_the_pods_tls_files(chart: Any) -> None:
    """The exec probe runs in the container: `pdserve health` must read the container's
    PDSERVE_TLS_* variables to speak mutual TLS to the worker's gRPC port."""
    parser = build_parser()
    assert parser._subparsers is not None
    health = cast(dict[str, argparse.ArgumentParser],
                  parser._subparsers._group_actions[0].choices)["health"]
    reads = {FLAGS[a.option_strings[0][2:]].env for a in health._actions
             if a.option_strings and a.option_strings[0][2:] in FLAGS}
    worker = by_kind(render(chart, CERT_MANAGER), "Deployment")["pd-pdserve-decode"]
    assert set(TLS_ENV) <= set(env_of(worker))  # the container has them ...
    assert set(TLS_ENV) <= reads  # ... and the probe's command reads them


def test_tls_etcd_serves_only_https_with_client_certificates(chart: Any, tmp_path: Path
                                                             ) -> None:
    """The chart's etcd, from its own rendered environment: it answers a client with a
    certificate the CA signed, and refuses one without and a plaintext one."""
    docs = render(chart, CERT_MANAGER)
    (etcd,) = by_kind(docs, "StatefulSet").values()
    env = etcd_env(docs)
    for prefix in ("ETCD", "ETCD_PEER"):
        assert env[f"{prefix}_CLIENT_CERT_AUTH"] == "true"
        for var, key in (("CERT_FILE", "tls.crt"), ("KEY_FILE", "tls.key"),
                         ("TRUSTED_CA_FILE", "ca.crt")):
            assert env[f"{prefix}_{var}"] == f"/etc/pdserve/tls/{key}"
            assert mounted_secret(etcd, env[f"{prefix}_{var}"]) == "pd-pdserve-tls"
    for var in ("ETCD_LISTEN_CLIENT_URLS", "ETCD_ADVERTISE_CLIENT_URLS", "ETCD_LISTEN_PEER_URLS",
                "ETCD_INITIAL_ADVERTISE_PEER_URLS"):
        assert env[var].startswith("https://"), var
    for probe in ("readinessProbe", "livenessProbe"):
        command = container(etcd)[probe]["exec"]["command"]
        assert command[0] == "etcdctl" and command[-2:] == ["endpoint", "health"]
        assert {"--endpoints=https://127.0.0.1:2379", "--cacert=/etc/pdserve/tls/ca.crt",
                "--cert=/etc/pdserve/tls/tls.crt", "--key=/etc/pdserve/tls/tls.key"} <= set(
            command)

    files = make_test_ca(tmp_path / "tls")  # names 127.0.0.1, where the local etcd listens
    local = localize(env, {"/etc/pdserve/tls/tls.crt": Path(str(files.cert)),
                           "/etc/pdserve/tls/tls.key": Path(str(files.key)),
                           "/etc/pdserve/tls/ca.crt": Path(str(files.ca))}, tmp_path / "data")
    with running_etcd(local, tmp_path / "etcd.log") as url:
        assert url.startswith("https://127.0.0.1:")
        assert tls_refusals(url, Path(str(files.ca))) == ["refused", "refused"]


def test_tls_off_renders_no_certificate_and_plaintext_cluster(chart: Any) -> None:
    docs = render(chart)
    assert not by_kind(docs, "Certificate")
    for deployment in by_kind(docs, "Deployment").values():
        assert not {*TLS_ENV, "PDSERVE_REQUIRE_TLS"} & set(env_of(deployment))
        assert env_of(deployment)["PDSERVE_ETCD"] == "http://pd-pdserve-etcd:2379"
        pod = deployment["spec"]["template"]["spec"]
        assert "tls" not in {v["name"] for v in pod["volumes"]}
    env = etcd_env(docs)
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "http://0.0.0.0:2379"
    assert not any(name.endswith(("_CERT_FILE", "_CERT_AUTH")) for name in env)
    services = by_kind(docs, "Service")
    assert "publishNotReadyAddresses" not in services["pd-pdserve-decode"]["spec"]


def test_tls_from_an_existing_secret(chart: Any) -> None:
    docs = render(chart, {"tls": {"enabled": True, "existingSecret": "our-tls"}})
    assert not by_kind(docs, "Certificate")
    for deployment in by_kind(docs, "Deployment").values():
        assert mounted_secret(deployment, env_of(deployment)["PDSERVE_TLS_CA"]) == "our-tls"
    (etcd,) = by_kind(docs, "StatefulSet").values()
    assert mounted_secret(etcd, etcd_env(docs)["ETCD_TRUSTED_CA_FILE"]) == "our-tls"
    external = render(chart, {"tls": {"enabled": True, "existingSecret": "our-tls"},
                              "etcd": {"enabled": False,
                                       "externalEndpoint": "https://etcd.db:2379"}})
    assert not by_kind(external, "StatefulSet")
    for deployment in by_kind(external, "Deployment").values():
        assert env_of(deployment)["PDSERVE_ETCD"] == "https://etcd.db:2379"


TLS_MISTAKES = {
    "no certificate": ({"tls": {"enabled": True}}, "tls.existingSecret"),
    "two certificates": ({"tls": {**CERT_MANAGER["tls"], "existingSecret": "ours"}},
                         "not both"),
    "cert-manager without tls": (
        {"tls": {"certManager": CERT_MANAGER["tls"]["certManager"]}}, "needs tls.enabled"),
    "ucx under require-tls": ({**CERT_MANAGER, "decode": {"transport": "ucx"}},
                              "decode.transport ucx moves KV unencrypted"),
    "a plaintext external etcd under require-tls": (
        {**CERT_MANAGER, "etcd": {"enabled": False, "externalEndpoint": "http://etcd.db:2379"}},
        "must be https://"),
}


@pytest.mark.parametrize(("values", "why"), TLS_MISTAKES.values(), ids=TLS_MISTAKES.keys())
def test_tls_mistakes_fail_the_render_with_the_reason(chart: Any, values: dict[str, Any],
                                                      why: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(why)):
        render(chart, values)


def test_tls_without_require_allows_an_unencrypted_transport(chart: Any) -> None:
    docs = render(chart, {"tls": {**CERT_MANAGER["tls"], "require": False},
                          "decode": {"transport": "ucx"}})
    assert env_of(by_kind(docs, "Deployment")["pd-pdserve-decode"])["PDSERVE_TRANSPORT"] == "ucx"
