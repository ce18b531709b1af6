"""The etcd a deploy file describes (the chart's StatefulSet, compose's service), run from
its own ``ETCD_*`` environment as a local process, so that a TLS setting etcd would
refuse or ignore shows here. Only what a single host forces is substituted: every
``scheme://HOST:PORT`` → ``scheme://127.0.0.1:<free port>``, the data directory → a temp
folder, and the container's paths of the TLS files → local ones."""

from __future__ import annotations

import re
import shutil
import ssl
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from pdserve.core import process
from pdserve.core.ports import free_port

START_TIMEOUT_S = 15.0
_URL = re.compile(r"\b(https?)://[^/:,\s]+:(\d+)")


def localize(env: Mapping[str, str], files: Mapping[str, Path], data_dir: Path
             ) -> dict[str, str]:
    """``env`` with its URLs on loopback (one free port per container port), its data
    directory ``data_dir`` and each container path of ``files`` the local file."""
    ports: dict[str, int] = {}

    def url(match: re.Match[str]) -> str:
        port = ports.setdefault(match[2], free_port())
        return f"{match[1]}://127.0.0.1:{port}"

    out = {}
    for key, value in env.items():
        if key == "ETCD_DATA_DIR":
            out[key] = str(data_dir)
        elif value in files:
            out[key] = str(files[value])
        else:
            out[key] = _URL.sub(url, value)
    return out


@contextmanager
def running_etcd(env: Mapping[str, str], log: Path) -> Iterator[str]:
    """etcd started with ``env`` alone (no other ``ETCD_*`` variable); yields its first
    client URL once it answers ``/health`` (over TLS with the env's own client
    certificate when the URL is https). Stopped, with its process group, on exit."""
    binary = shutil.which("etcd")
    if binary is None:
        pytest.fail("no etcd binary: make etcd installs one (apt-get install etcd-server)",
                    pytrace=False)
    client_url = env["ETCD_ADVERTISE_CLIENT_URLS"].split(",")[0]
    verify: ssl.SSLContext | bool = False
    if client_url.startswith("https://"):
        verify = ssl.create_default_context(cafile=env["ETCD_TRUSTED_CA_FILE"])
        verify.load_cert_chain(env["ETCD_CERT_FILE"], env["ETCD_KEY_FILE"])
    proc = process.spawn([binary], log_path=log, env=dict(env),
                         base_env={"PATH": "/usr/bin:/bin"})
    try:
        def healthy() -> str:
            try:
                reply = httpx.get(client_url + "/health", verify=verify, timeout=1)
            except httpx.HTTPError as exc:
                return f"GET {client_url}/health: {exc!r}"
            return "" if reply.is_success else f"GET {client_url}/health: {reply.status_code}"

        def exited() -> str | None:
            if proc.poll() is None:
                return None
            return f"etcd exited {proc.returncode}: {log.read_text()[-800:]}"

        process.wait_ready(healthy, START_TIMEOUT_S, exited=exited, interval_s=0.1)
        yield client_url
    finally:
        report = process.stop([proc], grace_s=5)
        assert not report.left_behind


def tls_refusals(client_url: str, ca: Path) -> list[str]:
    """How etcd at https ``client_url`` answered clients it must refuse: one without a
    client certificate, one in plaintext (each: "refused", or what it got instead)."""
    plain = client_url.replace("https://", "http://")
    answers = []
    for url, verify in ((client_url, ssl.create_default_context(cafile=str(ca))),
                        (plain, False)):
        try:
            reply = httpx.get(url + "/health", verify=verify, timeout=2)
        except (httpx.HTTPError, ssl.SSLError):
            answers.append("refused")
        else:
            answers.append(f"{reply.status_code} {reply.text[:80]}")
    return answers
