"""deploy/compose/docker-compose.kv-store.yml, offline: docker-compose merges it over the
base file (and beside the TLS overlay), every worker gets the store's URL and password
file as flags its process reads, and the redis service, run from its own merged command
on the local redis-server, requires the secret's password and enforces its memory cap."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml
from unit.redis_from_script import probe_passes, running_redis, server_settings
from unit.test_deploy_compose_config import COMPOSE_DIR, _flag_envs, docker_compose

from pdserve.cli.configs import connector_config
from pdserve.cli.parser import build_parser

BASE = COMPOSE_DIR / "docker-compose.yml"
KV_OVERLAY = COMPOSE_DIR / "docker-compose.kv-store.yml"
TLS_OVERLAY = COMPOSE_DIR / "docker-compose.tls.yml"
SECRET = "/run/secrets/kv_store_password"


def merged(*overlays: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    files = [arg for f in (BASE, *overlays) for arg in ("-f", str(f))]
    result = subprocess.run(["docker-compose", *files, "config"], cwd=COMPOSE_DIR,
                            capture_output=True, text=True, timeout=60,
                            env={"PATH": "/usr/bin:/bin", **(env or {})})
    assert result.returncode == 0, result.stderr
    config: dict[str, Any] = yaml.safe_load(result.stdout)
    return config


@pytest.fixture(scope="module")
def kv_config() -> dict[str, Any]:
    return merged(KV_OVERLAY)


def test_docker_compose_accepts_the_overlay_alone_and_beside_tls() -> None:
    for overlays in ([KV_OVERLAY], [TLS_OVERLAY, KV_OVERLAY]):
        files = [arg for f in (BASE, *overlays) for arg in ("-f", str(f))]
        result = docker_compose(*files, "config", "-q")
        assert result.returncode == 0, result.stderr


def test_workers_get_the_store_and_its_password_file_as_flags(
        kv_config: dict[str, Any]) -> None:
    services = kv_config["services"]
    assert "PDSERVE_KV_STORE" not in yaml.safe_load(BASE.read_text())["x-worker-env"]
    assert kv_config["secrets"]["kv_store_password"]["file"] == str(
        COMPOSE_DIR / "secrets" / "kv_store_password")
    for role in ("prefill", "decode"):
        worker = services[role]
        env = worker["environment"]
        (command,) = worker["command"]
        used = {k for k in env if k.startswith("PDSERVE_")}
        assert used <= _flag_envs(command) | _flag_envs("health"), used
        assert {s["source"] for s in worker["secrets"]} == {"cluster_secret",
                                                            "kv_store_password"}
        assert worker["depends_on"]["redis"] == {"condition": "service_started"}
        assert worker["depends_on"]["etcd"] == {"condition": "service_healthy"}  # kept
        # What the worker's connector makes of the environment.
        argv = [command] + [f"--{k[len('PDSERVE_'):].lower().replace('_', '-')}={v}"
                            for k, v in env.items() if k.startswith("PDSERVE_KV_")]
        # (the secret's file exists in the container only: its reading is stood in for)
        with mock.patch("pdserve.kv_transfer.config.read_password", return_value="pw"):
            connector = connector_config(build_parser().parse_args(argv), role, "10.0.0.2")
        assert (connector.kv_store, connector.kv_store_password_file) == (
            "redis://redis:6379", SECRET)
        assert (connector.kv_store_ttl_s, connector.kv_compression,
                connector.kv_store_admission) == (3600.0, "none", "all")
    assert "PDSERVE_KV_STORE" not in services["router"]["environment"]
    assert "ports" not in services["redis"]  # the compose network's only
    both = merged(TLS_OVERLAY, KV_OVERLAY)["services"]["decode"]
    assert {s["source"] for s in both["secrets"]} == {
        "cluster_secret", "kv_store_password", "tls_cert", "tls_key", "tls_ca"}
    assert both["environment"]["PDSERVE_REQUIRE_TLS"] == "true"


def test_the_store_settings_follow_the_environment() -> None:
    services = merged(KV_OVERLAY, env={"PDSERVE_KV_COMPRESSION": "lossless",
                                       "PDSERVE_KV_STORE_TTL_S": "600",
                                       "REDIS_MAXMEMORY": "8gb"})["services"]
    env = services["prefill"]["environment"]
    assert (env["PDSERVE_KV_COMPRESSION"], env["PDSERVE_KV_STORE_TTL_S"]) == ("lossless", "600")
    assert '--maxmemory "8gb"' in services["redis"]["command"][0]


def test_compose_redis_requires_the_password_and_caps_its_memory(
        kv_config: dict[str, Any], tmp_path: Path) -> None:
    """compose's redis service, from its merged command, on the local redis-server."""
    service = kv_config["services"]["redis"]
    assert service["entrypoint"] == ["/bin/sh", "-c"] and service["user"] == "999:999"
    (script,) = service["command"]
    password = "pw+/from=secret"
    with running_redis(script, SECRET, password, tmp_path) as (port, local_file):
        assert server_settings(port, password) == {
            "auth": "required", "maxmemory": str(1 << 30),
            "maxmemory-policy": "allkeys-lru", "save": "", "appendonly": "no"}
        # Its health check, as the container runs it, passes; with a wrong password it fails.
        test = service["healthcheck"]["test"]
        assert test[0] == "CMD-SHELL"
        assert probe_passes(test[1], SECRET, local_file, port)
        local_file.write_text("wrong\n")
        assert not probe_passes(test[1], SECRET, local_file, port)
