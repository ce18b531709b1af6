"""deploy/compose, offline: Debian's docker-compose accepts the file (with and without
the monitoring profile), every PDSERVE_* variable is one its process reads, workers
scale (each replica advertises itself), and Prometheus and Grafana point at what the
services serve. tests/integration/test_deploy_compose.py runs the services themselves."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from pdserve_testing import COMPOSE_FILE, compose_services

from pdserve.cli.flags import FLAGS
from pdserve.cli.health import HealthTarget
from pdserve.cli.main import build_parser

COMPOSE_DIR = COMPOSE_FILE.parent
ROOT = COMPOSE_DIR.parents[1]
PDSERVE_SERVICES = ("router", "prefill", "decode")


def docker_compose(*args: str, cwd: Path = COMPOSE_DIR) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (make etcd installs Debian's)")
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
    subcommands = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
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
    assert set(services["router"]["secrets"]) == {"cluster_secret", "api_key"}
    assert router_env["PDSERVE_API_KEY_FILE"] == "/run/secrets/api_key"
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
