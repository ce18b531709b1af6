"""deploy/compose, offline: Debian's docker-compose accepts the file (with and without
the monitoring profile), every PDSERVE_* variable is one its process reads, workers
scale (each replica advertises itself), and Prometheus and Grafana point at what the
services serve. tests/integration/test_deploy_compose.py runs the services themselves."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import pytest
import yaml
from pdserve_testing import COMPOSE_FILE, compose_services
from unit.etcd_from_env import localize, running_etcd, tls_refusals

from pdserve.cli.flags import FLAGS
from pdserve.cli.health import HealthTarget
from pdserve.cli.parser import build_parser

COMPOSE_DIR = COMPOSE_FILE.parent
ROOT = COMPOSE_DIR.parents[1]
PDSERVE_SERVICES = ("router", "prefill", "decode")


def docker_compose(*args: str, cwd: Path = COMPOSE_DIR) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail("docker-compose is not installed: make etcd installs Debian's "
                    "(apt-get install docker-compose)", pytrace=False)
    return subprocess.run([binary, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("profile", [[], ["--profile", "monitoring"]], ids=["core", "monitoring"])
def test_docker_compose_accepts_the_file(profile: list[str]) -> None:
    result = docker_compose("-f", str(COMPOSE_FILE), *profile, "config", "-q")
    assert result.returncode == 0, result.stderr


def test_docker_compose_config_bites(tmp_path: Path) -> None:
    """The same check refuses the file with a misspelt key."""
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(COMPOSE_FILE.read_text().replace("stop_grace_period:", "stop_grace:"))
    result = docker_compose("-f", str(broken), "config", "-q", cwd=tmp_path)
    assert result.returncode != 0 and "stop_grace" in result.stderr


def _flag_envs(command: str) -> set[str]:
    subparsers = build_parser()._subparsers
    assert subparsers is not None
    subcommands = cast(dict[str, argparse.ArgumentParser], subparsers._group_actions[0].choices)
    names = {a.option_strings[0][2:] for a in subcommands[command]._actions
             if a.option_strings and a.option_strings[0].startswith("--")}
    return {FLAGS[name].env for name in names if name in FLAGS}


def test_every_pdserve_variable_is_read_by_its_process() -> None:
    """A misspelt variable would be ignored silently: each is a flag of the service's
    subcommand or of `pdserve health` (the image's HEALTHCHECK, run in the container)."""
    services = compose_services()
    for name in PDSERVE_SERVICES:
        (command,) = services[name]["command"]
        accepted = _flag_envs(command) | _flag_envs("health")
        used = {k for k in services[name]["environment"] if k.startswith("PDSERVE_")}
        assert used <= accepted, (name, used - accepted)


def test_workers_scale_and_each_replica_advertises_itself() -> None:
    services = compose_services()
    for role in ("prefill", "decode"):
        worker = services[role]
        env = worker["environment"]
        assert worker["command"] == [role]
        # No fixed name, host port, id or advertised address: `--scale` gives every
        # replica its own container, id (<role>-<random>) and IP (its hostname's address).
        assert not {"container_name", "ports", "hostname"} & set(worker)
        assert not {"PDSERVE_WORKER_ID", "PDSERVE_ADVERTISE_HOST", "PDSERVE_KV_HOST"} & set(env)
        assert env["PDSERVE_HOST"] == "0.0.0.0"
        assert env["PDSERVE_ETCD"] == "http://etcd:2379"
        assert env["PDSERVE_CLUSTER"] == services["router"]["environment"]["PDSERVE_CLUSTER"]
        target = HealthTarget.parse(env["PDSERVE_HEALTHCHECK"])
        assert (target.scheme, target.port) == ("grpc", int(env["PDSERVE_PORT"]))
        assert worker["secrets"] == ["cluster_secret"]
    router_env = services["router"]["environment"]
    target = HealthTarget.parse(router_env["PDSERVE_HEALTHCHECK"])
    # The router is healthy when servable: its main port's /health (open without a key).
    assert (target.scheme, target.port, target.path) == (
        "http", int(router_env["PDSERVE_PORT"]), "/health")
    assert set(services["router"]["secrets"]) == {"cluster_secret", "api_key", "admin_key"}
    assert router_env["PDSERVE_API_KEY_FILE"] == "/run/secrets/api_key"
    # The admin plane on every interface (for Prometheus) only behind its own key.
    assert router_env["PDSERVE_ADMIN_HOST"] == "0.0.0.0"
    assert router_env["PDSERVE_ADMIN_KEY_FILE"] == "/run/secrets/admin_key"
    for name in PDSERVE_SERVICES:
        assert services[name]["environment"]["PDSERVE_CLUSTER_SECRET_FILE"] == (
            "/run/secrets/cluster_secret")
        assert "profiles" not in services[name]


def _prometheus_jobs() -> dict[str, dict[str, Any]]:
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    return {job["job_name"]: job for job in config["scrape_configs"]}


def test_prometheus_scrapes_the_router_admin_port_and_every_worker_by_dns() -> None:
    services = compose_services()
    jobs = _prometheus_jobs()
    admin_port = services["router"]["environment"]["PDSERVE_ADMIN_PORT"]
    assert jobs["pdserve-router"]["static_configs"][0]["targets"] == [f"router:{admin_port}"]
    # It sends the router's admin key: the secret the router reads, mounted in Prometheus.
    auth = jobs["pdserve-router"]["authorization"]
    key_file = services["router"]["environment"]["PDSERVE_ADMIN_KEY_FILE"]
    assert (auth["type"], auth["credentials_file"]) == ("Bearer", key_file)
    assert key_file == f"/run/secrets/{services['prometheus']['secrets'][0]}"
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    assert compose["secrets"]["admin_key"] == {"file": "./secrets/admin_key"}
    for role in ("prefill", "decode"):
        assert "authorization" not in jobs[f"pdserve-{role}"]  # workers' metrics: no key
    for role in ("prefill", "decode"):
        (sd,) = jobs[f"pdserve-{role}"]["dns_sd_configs"]
        metrics_port = int(services[role]["environment"]["PDSERVE_METRICS_PORT"])
        assert (sd["names"], sd["type"], sd["port"]) == ([role], "A", metrics_port)


def test_monitoring_is_a_profile_and_grafana_provisions_the_dashboard() -> None:
    services = compose_services()
    assert services["prometheus"]["profiles"] == ["monitoring"]
    assert services["grafana"]["profiles"] == ["monitoring"]
    assert "./prometheus.yml:/etc/prometheus/prometheus.yml:ro" in services["prometheus"][
        "volumes"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in services["grafana"]["volumes"])
    # The dashboard comes from deploy/grafana/pdserve.json, into the provider's folder.
    target = mounts["../grafana/pdserve.json"]
    assert (COMPOSE_DIR / "../grafana/pdserve.json").resolve() == (
        ROOT / "deploy" / "grafana" / "pdserve.json")
    provisioning = COMPOSE_DIR / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "pdserve.yml").read_text())[
        "providers"]
    assert provider["options"]["path"] == str(Path(target).parent)
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())[
        "datasources"]
    assert source["type"] == "prometheus" and source["isDefault"]
    assert source["url"] == f"http://prometheus:{services['prometheus']['ports'][0].split(':')[1]}"


# The TLS overlay: `docker compose -f docker-compose.yml -f docker-compose.tls.yml up`, with
# the certificates make-test-ca.sh writes.
TLS_OVERLAY = COMPOSE_DIR / "docker-compose.tls.yml"
MAKE_TEST_CA = COMPOSE_DIR / "make-test-ca.sh"
TLS_SECRETS = {"PDSERVE_TLS_CERT": "tls_cert", "PDSERVE_TLS_KEY": "tls_key",
               "PDSERVE_TLS_CA": "tls_ca"}


@pytest.fixture(scope="module")
def tls_config() -> dict[str, Any]:
    """The two files as docker-compose merges them (its own `config` output)."""
    result = docker_compose("-f", str(COMPOSE_FILE), "-f", str(TLS_OVERLAY), "config")
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


@pytest.fixture(scope="module")
def test_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """make-test-ca.sh run with this venv's pdserve, into a folder of the test's."""
    out = tmp_path_factory.mktemp("compose-tls") / "tls"
    result = subprocess.run([str(MAKE_TEST_CA), str(out)], capture_output=True, text=True,
                            timeout=60, env={"PATH": "/usr/bin:/bin",
                                             "PDSERVE": str(Path(sys.executable).parent /
                                                            "pdserve")})
    assert result.returncode == 0, result.stderr
    return out


def test_the_tls_overlay_gives_every_pdserve_service_the_files_and_require_tls(
        tls_config: dict[str, Any]) -> None:
    services = tls_config["services"]
    secrets = tls_config["secrets"]
    for key, name in (("cert", "tls_cert"), ("key", "tls_key"), ("ca", "tls_ca")):
        assert Path(secrets[name]["file"]) == COMPOSE_DIR / "secrets" / "tls" / f"{key}.pem"
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        mounted = {s["source"] for s in services[name]["secrets"]}
        for var, secret in TLS_SECRETS.items():
            assert env[var] == f"/run/secrets/{secret}" and secret in mounted
        assert "cluster_secret" in mounted  # the base file's secrets are kept
        assert env["PDSERVE_REQUIRE_TLS"] == "true"
        assert env["PDSERVE_ETCD"] == "https://etcd:2379"
        (command,) = services[name]["command"]
        used = {k for k in env if k.startswith("PDSERVE_")}
        assert used <= _flag_envs(command) | _flag_envs("health"), (name, used)
    assert "api_key" in {s["source"] for s in services["router"]["secrets"]}
    for role in ("prefill", "decode"):  # a name the certificate has, not the container IP
        assert services[role]["environment"]["PDSERVE_ADVERTISE_HOST"] == role
    assert services["router"]["ports"] == [{"published": 8000, "target": 8000}]  # plain HTTP

    etcd = services["etcd"]
    env = etcd["environment"]
    assert env["ETCD_LISTEN_CLIENT_URLS"] == "https://0.0.0.0:2379"
    assert env["ETCD_ADVERTISE_CLIENT_URLS"] == "https://etcd:2379"
    assert env["ETCD_CLIENT_CERT_AUTH"] == "true"
    assert {s["source"] for s in etcd["secrets"]} == set(TLS_SECRETS.values())
    check = etcd["healthcheck"]["test"]
    assert check[:2] == ["CMD", "etcdctl"] and check[-2:] == ["endpoint", "health"]
    assert {"--endpoints=https://127.0.0.1:2379", "--cacert=/run/secrets/tls_ca",
            "--cert=/run/secrets/tls_cert", "--key=/run/secrets/tls_key"} <= set(check)


def test_make_test_ca_writes_a_certificate_for_every_host_the_services_dial(
        tls_config: dict[str, Any], test_ca: Path) -> None:
    from cryptography import x509

    assert MAKE_TEST_CA.stat().st_mode & 0o111  # executable
    assert {p.name for p in test_ca.iterdir()} == {"ca.pem", "cert.pem", "key.pem"}
    assert (test_ca / "key.pem").stat().st_mode & 0o077 == 0
    cert = x509.load_pem_x509_certificate((test_ca / "cert.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    names = set(sans.get_values_for_type(x509.DNSName)) | {
        str(ip) for ip in sans.get_values_for_type(x509.IPAddress)}
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert {x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
            x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH} <= set(usages)
    services = tls_config["services"]
    dialled = {"127.0.0.1"}  # every container's health check
    for name in PDSERVE_SERVICES:
        env = services[name]["environment"]
        dialled.add(str(urlsplit(env["PDSERVE_ETCD"]).hostname))
        dialled.add(HealthTarget.parse(env["PDSERVE_HEALTHCHECK"]).host)
        dialled.add(env.get("PDSERVE_ADVERTISE_HOST", "127.0.0.1"))
    assert dialled == {"127.0.0.1", "etcd", "prefill", "decode"}
    assert dialled <= names
    # What it writes by default lands in a folder git ignores.
    ignored = subprocess.run(["git", "check-ignore", "-q", "secrets/tls/key.pem"],
                             cwd=COMPOSE_DIR, capture_output=True, timeout=30)
    assert ignored.returncode == 0
    assert "secrets/tls" in MAKE_TEST_CA.read_text()


def test_the_tls_overlays_etcd_serves_only_https_with_client_certificates(
        tls_config: dict[str, Any], test_ca: Path, tmp_path: Path) -> None:
    """compose's etcd from its merged environment, with make-test-ca.sh's files."""
    files = {f"/run/secrets/{secret}": test_ca / f"{key}.pem"
             for secret, key in (("tls_cert", "cert"), ("tls_key", "key"), ("tls_ca", "ca"))}
    env = localize(tls_config["services"]["etcd"]["environment"], files, tmp_path / "data")
    with running_etcd(env, tmp_path / "etcd.log") as url:
        assert tls_refusals(url, test_ca / "ca.pem") == ["refused", "refused"]
