"""deploy/compose/docker-compose.kv-store.yml, offline: docker-compose merges it over the
base file (and beside the TLS overlay), every worker gets the store's URL and password
file as flags its process reads, and the redis service, run from its own merged command
on the local redis-server, requires the secret's password and enforces its memory cap.
With docker-compose.kv-store-tls.yml it serves TLS only (client certificates required)
and the workers dial rediss://; beside the TLS overlay without it the workers refuse the
plaintext store."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import redis
import yaml
from unit.redis_from_script import client, probe_passes, running_redis, server_settings
from unit.test_deploy_compose_config import COMPOSE_DIR, _flag_envs, docker_compose

from pdserve.cli.configs import connector_config
from pdserve.cli.parser import build_parser
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles

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
    for overlays in ([KV_OVERLAY], [TLS_OVERLAY, KV_OVERLAY],
                     [TLS_OVERLAY, KV_OVERLAY, KV_TLS_OVERLAY]):
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


KV_TLS_OVERLAY = COMPOSE_DIR / "docker-compose.kv-store-tls.yml"
CONTAINER_TLS = TlsFiles("/run/secrets/tls_cert", "/run/secrets/tls_key", "/run/secrets/tls_ca")


def _compose_connector(worker: dict[str, Any], local: TlsFiles) -> Any:
    """A worker's connector from its store and TLS variables, the container's certificate
    files standing for a test CA's."""
    (command,) = worker["command"]
    paths = {CONTAINER_TLS.cert: local.cert, CONTAINER_TLS.key: local.key,
             CONTAINER_TLS.ca: local.ca}
    env = {k: str(paths.get(v, v)) for k, v in worker["environment"].items()
           if k.startswith(("PDSERVE_KV_", "PDSERVE_TLS_", "PDSERVE_REQUIRE"))}
    with mock.patch.dict(os.environ, env), mock.patch(
            "pdserve.kv_transfer.config.read_password", return_value="pw"):
        return connector_config(build_parser().parse_args([command]), command, "10.0.0.2")


def test_beside_tls_a_plaintext_store_is_refused_and_the_tls_overlay_serves(
        tmp_path: Path) -> None:
    local = make_test_ca(tmp_path / "ca")
    plain = merged(TLS_OVERLAY, KV_OVERLAY)["services"]
    with pytest.raises(ValueError, match="--require-tls refuses the plaintext KV store"):
        _compose_connector(plain["decode"], local)
    services = merged(TLS_OVERLAY, KV_OVERLAY, KV_TLS_OVERLAY)["services"]
    for role in ("prefill", "decode"):
        connector = _compose_connector(services[role], local)
        assert connector.kv_store == "rediss://redis:6379" and connector.require_tls
        assert connector.store_tls() == local  # the cluster's own files
    redis_service = services["redis"]
    assert redis_service["user"] == "10001:999"  # the TLS files' owner
    assert {s["source"] for s in redis_service["secrets"]} == {
        "kv_store_password", "tls_cert", "tls_key", "tls_ca"}


def test_compose_tls_redis_runs_as_merged(tmp_path: Path) -> None:
    """The TLS overlay's redis command and health check, on the local redis-server."""
    service = merged(TLS_OVERLAY, KV_OVERLAY, KV_TLS_OVERLAY)["services"]["redis"]
    local = make_test_ca(tmp_path / "ca")
    tls = (CONTAINER_TLS, local)
    (script,) = service["command"]
    password = "pw+/from=secret"
    with running_redis(script, SECRET, password, tmp_path, tls) as (port, local_file):
        assert server_settings(port, password, local) == {
            "auth": "required", "maxmemory": str(1 << 30),
            "maxmemory-policy": "allkeys-lru", "save": "", "appendonly": "no"}
        test = service["healthcheck"]["test"]
        assert probe_passes(test[1], SECRET, local_file, port, tls)
        with client(port, password) as plain, pytest.raises(redis.ConnectionError):
            plain.ping()
        with client(port, password, TlsFiles(ca=local.ca)) as certless, pytest.raises(
                redis.ConnectionError):
            certless.ping()
