"""The Helm chart's cluster KV store (kvStore), offline: off by default; on, either the
chart's own Redis (StatefulSet, Service, generated password Secret, NetworkPolicy) or an
external URL (Redis Cluster too), rendered into the prefill and decode workers as flags
they read; every manifest valid Kubernetes; the chart's Redis, run from its own command on
the local redis-server, requires its password and enforces its memory cap."""

from __future__ import annotations

import argparse
import base64
import re
from pathlib import Path
from typing import Any, cast

import helm_python as helm
import kubernetes_validate
import pytest
from unit.redis_from_script import probe_passes, running_redis, server_settings
from unit.test_deploy_helm import (
    CERT_MANAGER,
    CHART,
    CRD_KINDS,
    EVERYTHING,
    KUBE_VERSION,
    by_kind,
    container,
    env_of,
    mounted_secret,
    render,
)

from pdserve.cli.configs import connector_config
from pdserve.cli.parser import build_parser

OWN = {"kvStore": {"enabled": True}}
CLUSTER_URL = "redis-cluster://redis-0.redis.db:6379,redis-1.redis.db:6379"
EXTERNAL = {"kvStore": {"enabled": True, "url": CLUSTER_URL, "compression": "lossless",
                        "password": {"existingSecret": "store-auth", "secretKey": "pw"}}}
KV_VALUES = {"own": OWN, "external": EXTERNAL,
             "own with everything": {**EVERYTHING, **OWN},
             "own under tls": {**CERT_MANAGER, **OWN}}
WORKERS = ("pd-pdserve-prefill", "pd-pdserve-decode")
PASSWORD_FILE = "/etc/pdserve/kv-store/password"


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def worker_connector(deployment: dict[str, Any]) -> Any:
    """What the worker's connector makes of its container's PDSERVE_KV_* variables."""
    (role,) = container(deployment)["args"]
    argv = [role] + [f"--{k[len('PDSERVE_'):].lower().replace('_', '-')}={v}"
                     for k, v in env_of(deployment).items() if k.startswith("PDSERVE_KV_S")
                     or k == "PDSERVE_KV_COMPRESSION"]
    return connector_config(build_parser().parse_args(argv), role, "10.0.0.2")


def own_redis(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return by_kind(docs, "StatefulSet")["pd-pdserve-redis"]


def test_off_by_default_nothing_of_the_store_renders(chart: Any) -> None:
    docs = render(chart)
    assert set(by_kind(docs, "StatefulSet")) == {"pd-pdserve-etcd"}
    assert not by_kind(docs, "NetworkPolicy") and "pd-pdserve-kv-store" not in by_kind(
        docs, "Secret")
    for deployment in by_kind(docs, "Deployment").values():
        assert not [k for k in env_of(deployment) if k.startswith(("PDSERVE_KV_STORE",
                                                                   "PDSERVE_KV_COMP"))]


@pytest.mark.parametrize("values", KV_VALUES.values(), ids=KV_VALUES.keys())
def test_kv_store_values_lint_clean_and_render_valid_kubernetes(
        chart: Any, values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not report["errors"] and not [m for m in report["messages"]
                                         if m["severity"] >= 2], report
    parser = build_parser()
    assert parser._subparsers is not None
    subcommands = cast(dict[str, argparse.ArgumentParser],
                       parser._subparsers._group_actions[0].choices)
    for doc in render(chart, values):
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in CRD_KINDS
        if doc["kind"] == "Deployment":  # every PDSERVE_* a flag of its subcommand
            (command,) = container(doc)["args"]
            actions = subcommands[command]._actions
            known = {a.option_strings[0] for a in actions if a.option_strings}
            used = {f"--{k[8:].lower().replace('_', '-')}" for k in env_of(doc)
                    if k.startswith("PDSERVE_")}
            assert used <= known, used - known


def test_the_charts_own_redis_serves_the_workers_with_a_generated_password(
        chart: Any) -> None:
    docs = render(chart, OWN)
    redis_set = own_redis(docs)
    service = by_kind(docs, "Service")["pd-pdserve-redis"]
    assert service["spec"]["ports"] == [{"name": "redis", "port": 6379, "targetPort": "redis"}]
    assert service["spec"]["selector"] == redis_set["spec"]["template"]["metadata"]["labels"]
    secret = by_kind(docs, "Secret")["pd-pdserve-kv-store"]
    assert len(base64.b64decode(secret["data"]["password"])) == 48
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert mounted_secret(redis_set, PASSWORD_FILE) == "pd-pdserve-kv-store"
    pod = redis_set["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 999
    assert {"name": "data", "emptyDir": {}} in pod["volumes"]  # a cache: nothing persisted
    deployments = by_kind(docs, "Deployment")
    for name in WORKERS:
        connector = worker_connector(deployments[name])
        assert connector.kv_store == "redis://pd-pdserve-redis:6379"
        assert connector.kv_store_password_file == PASSWORD_FILE
        assert (connector.kv_store_ttl_s, connector.kv_store_timeout_s,
                connector.kv_compression, connector.kv_store_admission) == (
            3600.0, 0.5, "none", "all")
        assert mounted_secret(deployments[name], PASSWORD_FILE) == "pd-pdserve-kv-store"
    assert "PDSERVE_KV_STORE" not in env_of(deployments["pd-pdserve-router"])


def test_only_this_releases_workers_reach_the_charts_redis(chart: Any) -> None:
    docs = render(chart, OWN)
    policy = by_kind(docs, "NetworkPolicy")["pd-pdserve-redis"]["spec"]
    redis_labels = own_redis(docs)["spec"]["template"]["metadata"]["labels"]
    assert policy["podSelector"]["matchLabels"] == redis_labels
    assert policy["policyTypes"] == ["Ingress"]
    (rule,) = policy["ingress"]
    (peer,) = rule["from"]
    assert rule["ports"] == [{"port": "redis", "protocol": "TCP"}]

    def admitted(labels: dict[str, str]) -> bool:
        selector = peer["podSelector"]
        (expr,) = selector["matchExpressions"]
        return (all(labels.get(k) == v for k, v in selector["matchLabels"].items())
                and labels.get(expr["key"]) in expr["values"])

    pods = {name: d["spec"]["template"]["metadata"]["labels"]
            for name, d in by_kind(docs, "Deployment").items()}
    assert {name for name, labels in pods.items() if admitted(labels)} == set(WORKERS)
    other_release = {**pods["pd-pdserve-decode"], "app.kubernetes.io/instance": "other"}
    assert not admitted(other_release)
    off = render(chart, {"kvStore": {"enabled": True,
                                     "redis": {"networkPolicy": {"enabled": False}}}})
    assert not by_kind(off, "NetworkPolicy")


def test_an_external_store_replaces_the_charts_redis(chart: Any) -> None:
    docs = render(chart, EXTERNAL)
    assert "pd-pdserve-redis" not in by_kind(docs, "StatefulSet")
    assert not by_kind(docs, "NetworkPolicy")
    assert "pd-pdserve-kv-store" not in by_kind(docs, "Secret")
    deployments = by_kind(docs, "Deployment")
    for name in WORKERS:
        connector = worker_connector(deployments[name])
        assert (connector.kv_store, connector.kv_compression) == (CLUSTER_URL, "lossless")
        assert connector.kv_store_password_file == "/etc/pdserve/kv-store/pw"
        assert mounted_secret(deployments[name], "/etc/pdserve/kv-store/pw") == "store-auth"
    open_store = render(chart, {"kvStore": {"enabled": True, "url": "redis://cache:6379/3"}})
    for name in WORKERS:
        worker = by_kind(open_store, "Deployment")[name]
        assert env_of(worker)["PDSERVE_KV_STORE"] == "redis://cache:6379/3"
        assert "PDSERVE_KV_STORE_PASSWORD_FILE" not in env_of(worker)
        pod = worker["spec"]["template"]["spec"]
        assert "kv-store-password" not in {v["name"] for v in pod["volumes"]}


def test_the_charts_redis_runs_as_rendered(chart: Any, tmp_path: Path) -> None:
    """Its container command and readiness probe, on the local redis-server."""
    docs = render(chart, {"kvStore": {"enabled": True, "redis": {
        "maxmemory": "64MB", "maxmemoryPolicy": "volatile-ttl"}}})
    main = container(own_redis(docs))
    assert main["command"][:2] == ["/bin/sh", "-c"]
    password = "generated-in-the-secret"
    with running_redis(main["command"][2], PASSWORD_FILE, password, tmp_path) as (
            port, local_file):
        assert server_settings(port, password) == {
            "auth": "required", "maxmemory": str(64 << 20),
            "maxmemory-policy": "volatile-ttl", "save": "", "appendonly": "no"}
        probe = main["readinessProbe"]["exec"]["command"]
        assert probe[:2] == ["/bin/sh", "-c"]
        assert probe_passes(probe[2], PASSWORD_FILE, local_file, port)
        local_file.write_text("wrong\n")
        assert not probe_passes(probe[2], PASSWORD_FILE, local_file, port)
    assert password not in str(main)  # the Secret's file, never the password itself


BAD_KV_VALUES = {
    "a password in the url": {"kvStore": {"enabled": True, "url": "redis://:pw@cache:6379"}},
    "an unknown scheme": {"kvStore": {"enabled": True, "url": "memcached://cache:11211"}},
    "an unknown compression": {"kvStore": {"enabled": True, "compression": "zstd"}},
    "no memory cap": {"kvStore": {"enabled": True, "redis": {"maxmemory": "0"}}},
    "noeviction (a full store refuses every write)": {
        "kvStore": {"enabled": True, "redis": {"maxmemoryPolicy": "noeviction"}}},
    "a zero ttl": {"kvStore": {"enabled": True, "ttlSeconds": 0}},
    "an unknown key": {"kvStore": {"enabled": True, "maxMemory": "1gb"}},
}


@pytest.mark.parametrize("values", BAD_KV_VALUES.values(), ids=BAD_KV_VALUES.keys())
def test_the_values_schema_refuses_bad_kv_store_values(chart: Any,
                                                       values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render(chart, values)


def test_the_schema_enums_are_pdserves_own_choices() -> None:
    import json

    from pdserve.cli.flags import FLAGS
    from pdserve.kv_transfer.remote.base import store_schemes
    from pdserve.kv_transfer.remote.local_redis import POLICIES

    kv = json.loads((CHART / "values.schema.json").read_text())["properties"]["kvStore"]
    assert set(kv["properties"]["compression"]["enum"]) == set(
        FLAGS["kv-compression"].choices or ())
    assert set(kv["properties"]["redis"]["properties"]["maxmemoryPolicy"]["enum"]) <= set(
        POLICIES)
    schemes = set(re.findall(r"([a-z-]+)://", kv["properties"]["url"]["pattern"]))
    assert schemes == set(store_schemes())


def test_the_notes_say_where_the_store_is_and_whether_it_has_a_password(chart: Any) -> None:
    def notes(values: dict[str, Any] | None) -> str:
        rendered = chart.render(values, name="pd", namespace="serving", is_install=True)
        return str(rendered["pdserve/templates/NOTES.txt"])

    assert "Cluster KV store" not in notes(None)
    assert ("Cluster KV store: redis://pd-pdserve-redis:6379 (the chart's Redis, maxmemory "
            "1gb, allkeys-lru; password in the Secret pd-pdserve-kv-store)") in notes(OWN)
    assert f"{CLUSTER_URL} (password from the Secret store-auth)" in notes(EXTERNAL)
    assert "redis://cache:6379 (no password)" in notes(
        {"kvStore": {"enabled": True, "url": "redis://cache:6379"}})
