"""The Helm chart's TLS to the cluster KV store (kvStore.tls), offline: under tls the
chart's Redis serves TLS only with the cluster's certificate (which names it) and the
workers dial rediss://; kvStore.tls.existingSecret gives the store its own CA and client
certificate (PDSERVE_KV_STORE_TLS_*); a plaintext store is refused under tls.require;
every manifest valid Kubernetes; the chart's Redis, run from its own TLS command on the
local redis-server, refuses plaintext and certificate-less clients."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import helm_python as helm
import kubernetes_validate
import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from unit.redis_from_script import client, probe_passes, running_redis, server_settings
from unit.test_deploy_helm import (
    CERT_MANAGER,
    CHART,
    CRD_KINDS,
    KUBE_VERSION,
    by_kind,
    container,
    env_of,
    mounted_secret,
    render,
    valid_for,
)
from unit.test_deploy_helm_kv_store import (
    EXTERNAL,
    OWN,
    PASSWORD_FILE,
    WORKERS,
    own_redis,
    worker_connector,
)

from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles

STORE_TLS = {"kvStore": {"enabled": True, "tls": {"enabled": True,
                                                  "existingSecret": "store-tls"}}}
TLS_DIR = "/etc/pdserve/kv-store-tls"
MOUNTED = TlsFiles(f"{TLS_DIR}/tls.crt", f"{TLS_DIR}/tls.key", f"{TLS_DIR}/ca.crt")
KV_TLS_VALUES = {"own under tls": {**CERT_MANAGER, **OWN}, "own, its own secret": STORE_TLS,
                 "external rediss": {"kvStore": {**EXTERNAL["kvStore"], "url": "rediss://c:6380",
                                                 "tls": {"existingSecret": "store-tls"}}}}


@pytest.fixture(scope="module")
def chart() -> Any:
    with helm.Chart.load(CHART) as loaded:
        yield loaded


def _connector(deployment: dict[str, Any]) -> Any:
    with mock.patch.object(TlsFiles, "load", return_value=None):  # files in the pod only
        return worker_connector(deployment)


@pytest.mark.parametrize("values", KV_TLS_VALUES.values(), ids=KV_TLS_VALUES.keys())
def test_kv_store_tls_values_lint_clean_and_render_valid_kubernetes(
        chart: Any, values: dict[str, Any]) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version=f"v{KUBE_VERSION}")
    assert not report["errors"] and not [m for m in report["messages"]
                                         if m["severity"] >= 2], report
    for doc in render(chart, values):
        try:
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            assert doc["kind"] in CRD_KINDS


def test_under_tls_the_charts_redis_serves_tls_with_the_clusters_certificate(
        chart: Any) -> None:
    plain = by_kind(render(chart, OWN), "Deployment")
    assert _connector(plain[WORKERS[0]]).kv_store == "redis://pd-pdserve-redis:6379"
    docs = render(chart, {**CERT_MANAGER, **OWN})
    redis_set = own_redis(docs)
    assert mounted_secret(redis_set, MOUNTED.ca or "") == "pd-pdserve-tls"
    script = container(redis_set)["command"][2]
    assert "--port 0 --tls-port 6379" in script and "--tls-auth-clients yes" in script
    (certificate,) = by_kind(docs, "Certificate").values()
    assert valid_for(certificate, "pd-pdserve-redis")  # the name the workers dial
    for name in WORKERS:
        worker = by_kind(docs, "Deployment")[name]
        assert _connector(worker).kv_store == "rediss://pd-pdserve-redis:6379"
        env = env_of(worker)  # the cluster's own files: --tls-*, nothing more
        assert env["PDSERVE_REQUIRE_TLS"] == "true" and env["PDSERVE_TLS_CA"]
        assert not [k for k in env if k.startswith("PDSERVE_KV_STORE_TLS")]


def test_a_store_secret_of_its_own_reaches_the_redis_and_the_workers(chart: Any) -> None:
    docs = render(chart, STORE_TLS)  # no cluster tls at all
    assert mounted_secret(own_redis(docs), MOUNTED.key or "") == "store-tls"
    for name in WORKERS:
        worker = by_kind(docs, "Deployment")[name]
        connector = _connector(worker)
        assert connector.kv_store == "rediss://pd-pdserve-redis:6379"
        assert connector.store_tls() == MOUNTED
        assert mounted_secret(worker, MOUNTED.cert or "") == "store-tls"
        assert mounted_secret(worker, PASSWORD_FILE) == "pd-pdserve-kv-store"


BAD = {
    "tls.require with a plaintext external store": (
        {**CERT_MANAGER, "kvStore": {"enabled": True, "url": "redis://cache:6379"}},
        "tls.require: kvStore.url must be rediss://"),
    "kvStore.tls with a plaintext external store": (
        {"kvStore": {"enabled": True, "url": "redis-cluster://a:7000",
                     "tls": {"enabled": True}}},
        "kvStore.tls.enabled: kvStore.url must be rediss://"),
    "the chart's TLS Redis without a certificate": (
        {"kvStore": {"enabled": True, "tls": {"enabled": True}}},
        "the chart's Redis needs a certificate"),
}


@pytest.mark.parametrize(("values", "why"), BAD.values(), ids=BAD.keys())
def test_a_plaintext_or_certificate_less_store_is_refused(chart: Any, values: dict[str, Any],
                                                          why: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=why):
        render(chart, values)


def test_the_charts_tls_redis_runs_as_rendered(chart: Any, tmp_path: Path) -> None:
    """Its TLS command and readiness probe, on the local redis-server, with a test CA."""
    main = container(own_redis(render(chart, STORE_TLS)))
    local = make_test_ca(tmp_path / "ca")
    tls = (MOUNTED, local)
    password = "generated-in-the-secret"
    with running_redis(main["command"][2], PASSWORD_FILE, password, tmp_path, tls) as (
            port, local_file):
        assert server_settings(port, password, local)["auth"] == "required"
        probe = main["readinessProbe"]["exec"]["command"]
        assert probe_passes(probe[2], PASSWORD_FILE, local_file, port, tls)
        with redis.Redis(port=port, password=password, socket_timeout=1,
                         retry=Retry(NoBackoff(), 0)) as plain, pytest.raises(
                redis.ConnectionError):
            plain.ping()
        with client(port, password, TlsFiles(ca=local.ca)) as certless, pytest.raises(
                redis.ConnectionError):
            certless.ping()
        with client(port, password, local) as good:
            assert good.ping()
