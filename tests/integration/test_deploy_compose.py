"""deploy/compose/docker-compose.yml's own services, run as local processes (no Docker
here): etcd, the router, one prefill and one decode worker, each started with the
file's ``command`` (behind the image's entrypoint, read from the Dockerfile) and the
file's ``environment``, then one chat request served through the router.

Only what a single host forces is substituted:
- service hostnames (``etcd``, ``router``, ...) and the ``0.0.0.0`` bind address → 127.0.0.1;
- every port → a free port per (service, port): prefill and decode share theirs inside
  their containers;
- ``/run/secrets/<name>`` → files this test writes; etcd's volume → a temp folder;
- the entrypoint ``pdserve`` → this venv's; the model is the image's default, here the
  locally prepared one (``PDSERVE_CACHE``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pdserve_testing import COMPOSE_FILE, compose_services, wait_until

from pdserve.core import process
from pdserve.core.cluster_secret import load_cluster_secret, write_cluster_secret
from pdserve.core.ports import free_port
from pdserve.router.dispatch.workers.client import probe_load

pytestmark = pytest.mark.integration

DOCKERFILE = COMPOSE_FILE.parents[1] / "docker" / "Dockerfile"
SERVICES = ("etcd", "router", "prefill", "decode")  # in start order
READY_TIMEOUT_S = 300
LONG_PROMPT = "Tell me about rivers, mountains and forests. " * 40  # > 256 tokens: P → D


@dataclass
class Localizer:
    """Maps the compose file's container-side addresses to this host's."""

    services: dict[str, dict]
    tmp: Path
    ports: dict[tuple[str, int], int] = field(default_factory=dict)

    def port(self, service: str, port: int) -> int:
        if (service, port) not in self.ports:
            taken = set(self.ports.values())
            self.ports[(service, port)] = next(
                p for p in iter(free_port, None) if p not in taken)
        return self.ports[(service, port)]

    def env(self, service: str) -> dict[str, str]:
        volumes = dict(v.split(":")[:2][::-1] for v in self.services[service].get("volumes", []))
        out = {}
        for key, value in self.services[service]["environment"].items():
            value = re.sub(r"/run/secrets/(\w+)", lambda m: str(self.tmp / "secrets" / m[1]),
                           value)
            value = re.sub(r"\b([a-z][a-z0-9_-]*|\d+\.\d+\.\d+\.\d+):(\d+)\b",
                           lambda m: self._host_port(service, m[1], int(m[2])), value)
            if key.endswith("_PORT") and value.isdigit():
                value = str(self.port(service, int(value)))
            if value in volumes:  # a named volume's mount point
                value = str(self.tmp / volumes[value])
            out[key] = "127.0.0.1" if value == "0.0.0.0" else value
        return out

    def _host_port(self, service: str, host: str, port: int) -> str:
        owner = host if host in self.services else service  # 0.0.0.0, 127.0.0.1: its own
        return f"127.0.0.1:{self.port(owner, port)}"


def entrypoint() -> list[str]:
    """The image's ENTRYPOINT, with ``pdserve`` resolved to this venv's."""
    (line,) = [ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT")]
    command = json.loads(line.removeprefix("ENTRYPOINT"))
    assert command == ["pdserve"]
    return [str(Path(sys.executable).parent / "pdserve")]


@dataclass
class Stack:
    local: Localizer
    procs: dict[str, subprocess.Popen[bytes]]
    logs: Path
    api_key: str
    admin_key: str

    def url(self, service: str, port_var: str) -> str:
        return f"http://127.0.0.1:{self.local.env(service)[port_var]}"

    def tail(self) -> str:
        return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-15:])
                         for p in sorted(self.logs.glob("*.log")))

    def dead(self) -> list[str]:
        return [name for name, proc in self.procs.items() if proc.poll() is not None]


def _start(name: str, argv: list[str], env: dict[str, str], logs: Path
           ) -> subprocess.Popen[bytes]:
    return process.spawn(argv, log_path=logs / f"{name}.log", env=env, base_env={})


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    """SIGTERM in reverse start order (workers drain, etcd last), then SIGKILL what is
    left (engine processes included); nothing of any group may remain."""
    report = process.stop(list(reversed(procs.values())), grace_s=45)
    assert not report.left_behind, f"processes left: {report.left_behind}"


@pytest.fixture(scope="module")
def stack(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("compose")
    (tmp / "secrets").mkdir()
    write_cluster_secret(tmp / "secrets" / "cluster_secret")
    api_key = "sk-compose-test-key"
    (tmp / "secrets" / "api_key").write_text(api_key + "\n")
    admin_key = "adm-compose-test-key"
    (tmp / "secrets" / "admin_key").write_text(admin_key + "\n")
    services = compose_services()
    local = Localizer(services, tmp)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PDSERVE_", "ETCD_"))}
    base.update(HF_HUB_OFFLINE="1", PDSERVE_CACHE=str(model_path.parents[1]))
    procs: dict[str, subprocess.Popen[bytes]] = {}
    stack = Stack(local, procs, tmp, api_key, admin_key)
    try:
        for name in SERVICES:
            service = services[name]
            argv = service["command"] if name == "etcd" else entrypoint() + service["command"]
            procs[name] = _start(name, argv, {**base, **local.env(name)}, tmp)
        yield stack
    finally:
        _stop(procs)


def _healthy(stack: Stack, service: str) -> bool:
    """The service's own container health check: `pdserve health` with its environment."""
    env = {**os.environ, **stack.local.env(service)}
    return subprocess.run([*entrypoint(), "health", "--health-timeout-s", "2"], env=env,
                          capture_output=True, timeout=30).returncode == 0


def assert_served_chat(body: dict, max_tokens: int) -> None:
    """What a served chat answer shows whatever the CPU (bf16 under AMX changes the
    text itself): one choice with non-empty content, a finish reason, and the usage
    counting the tokens it ran (never what the model knows)."""
    assert len(body["choices"]) == 1, body
    choice = body["choices"][0]
    content = choice["message"]["content"]
    assert isinstance(content, str) and content.strip(), f"empty answer: {body}"
    assert choice["finish_reason"] in ("stop", "length"), body
    usage = body["usage"]
    assert 1 <= usage["completion_tokens"] <= max_tokens, usage
    assert usage["prompt_tokens"] > 0, usage
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    if choice["finish_reason"] == "length":
        assert usage["completion_tokens"] == max_tokens, body


def test_compose_services_serve_a_chat_request(stack: Stack) -> None:
    admin = stack.url("router", "PDSERVE_ADMIN_PORT")

    def workers() -> dict[str, str]:
        """role -> endpoint of the healthy workers the router found through etcd."""
        if stack.dead():
            raise AssertionError(f"{stack.dead()} exited\n{stack.tail()}")
        try:
            view = httpx.get(admin + "/workers", timeout=5,
                             headers={"Authorization": f"Bearer {stack.admin_key}"}
                             ).json()["workers"]
        except httpx.HTTPError:
            return {}
        return {w["role"]: w["endpoint"] for w in view if w["healthy"]}

    def both() -> dict[str, str]:
        found = workers()
        return found if len(found) == 2 else {}

    endpoints = wait_until(both, READY_TIMEOUT_S, interval_s=1)
    assert endpoints, f"not ready after {READY_TIMEOUT_S} s\n{stack.tail()}"
    # Each worker registered the address it advertises (bound to 127.0.0.1 here).
    assert endpoints == {
        role: f"127.0.0.1:{stack.local.env(role)['PDSERVE_PORT']}"
        for role in ("prefill", "decode")}
    # Servable, and every service's own container health check says so.
    assert httpx.get(stack.url("router", "PDSERVE_PORT") + "/health", timeout=5).is_success
    assert all(_healthy(stack, s) for s in ("prefill", "decode", "router"))
    # The admin plane takes the admin key only (what Prometheus sends), never a client's.
    for headers in ({}, {"Authorization": f"Bearer {stack.api_key}"}):
        for path in ("/workers", "/metrics"):
            assert httpx.get(admin + path, headers=headers, timeout=5).status_code == 401
    scraped = httpx.get(admin + "/metrics", timeout=5,
                        headers={"Authorization": f"Bearer {stack.admin_key}"})
    assert scraped.status_code == 200 and "pdserve:" in scraped.text

    api = stack.url("router", "PDSERVE_PORT") + "/v1/chat/completions"
    question: dict[str, Any] = {
        "model": "SmolLM2-135M-Instruct", "max_tokens": 24, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    assert httpx.post(api, json=question, timeout=60).status_code == 401  # the key's secret
    headers = {"Authorization": f"Bearer {stack.api_key}"}
    answer = httpx.post(api, json=question, headers=headers, timeout=120)
    assert answer.status_code == 200, answer.text
    assert_served_chat(answer.json(), question["max_tokens"])

    # A long prompt goes prefill → decode: decode loads its KV over the transport from
    # the KV endpoint prefill advertised.
    secret = load_cluster_secret(stack.local.env("decode")["PDSERVE_CLUSTER_SECRET_FILE"])
    before = probe_load(endpoints["decode"], timeout_s=5, secret=secret).prompt_tokens_external
    long = dict(question, max_tokens=4, messages=[{"role": "user", "content": LONG_PROMPT}])
    reply = httpx.post(api, json=long, headers=headers, timeout=120)
    assert reply.status_code == 200, reply.text
    after = probe_load(endpoints["decode"], timeout_s=5, secret=secret).prompt_tokens_external
    assert after - before >= 256, f"decode loaded {after - before} prompt tokens\n{stack.tail()}"


def _chat_body(content: str, completion_tokens: int,
               finish_reason: str = "length") -> dict[str, Any]:
    return {"choices": [{"index": 0, "finish_reason": finish_reason,
                         "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 9, "completion_tokens": completion_tokens,
                      "total_tokens": 9 + completion_tokens}}


def test_the_compose_check_holds_any_text_and_fails_an_empty_answer() -> None:
    """The check above on answers the router could give: any non-empty text passes (the
    AMX machine's French answer too); an empty answer, or one whose usage does not add
    up, fails."""
    assert_served_chat(_chat_body(" L'Étoile, la Marseillaise", 24), 24)
    assert_served_chat(_chat_body("Paris.", 3, "stop"), 24)
    bad: dict[str, Any]
    for bad in (_chat_body("", 24), _chat_body("  \n", 24), _chat_body("Paris", 0, "stop"),
                _chat_body("Paris", 5, "length"), {"choices": [], "usage": {}}):
        with pytest.raises(AssertionError):
            assert_served_chat(bad, 24)
