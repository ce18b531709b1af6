"""A single-member etcd on loopback, for ``pdserve up --with-etcd`` and tests.

Runs the ``etcd`` binary (Debian: ``apt-get install etcd-server``) on free ports
with a temporary data directory; ``stop()`` kills it and removes the directory.
``host`` and ``spawn`` put it elsewhere (a test's host: a network namespace, whose
``spawn`` starts it there and whose address it listens on); its health check then runs
where the caller's thread is, so a caller outside that network calls ``start`` from
inside it.
``stop(keep_data=True)`` then ``start()`` restarts it on the same ports and data.

With ``tls`` (mutual: a certificate, its key and the CA; ``pdserve certs`` makes them) every
listener is TLS: clients on ``https://127.0.0.1:PORT`` must present a certificate the CA
signed (``--client-cert-auth``), and so must the peer listener (``--peer-client-cert-auth``;
a single member has no peers, but nothing plaintext is left listening). The certificate must
name ``127.0.0.1``. The health check presents the same client certificate.

``gateway_keys`` reads a key range through etcd's JSON gateway (plain HTTP, no gRPC: it
works from a thread inside a host, where gRPC's own threads would not follow).
"""

from __future__ import annotations

import base64
import shutil
import signal
import ssl
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

from pdserve.core import process
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.ports import free_port

START_TIMEOUT_S = 30.0
Spawn = Callable[[Sequence[str], Path | None], "subprocess.Popen[bytes]"]


def gateway_keys(url: str, prefix: str, client: httpx.Client | None = None
                 ) -> dict[str, bytes]:
    """The keys under ``prefix`` and their values (etcd's JSON gateway at ``url``,
    plaintext), or {} when etcd is unreachable."""
    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode()

    end = prefix.encode()[:-1] + bytes([prefix.encode()[-1] + 1])
    body = {"key": b64(prefix.encode()), "range_end": b64(end)}
    try:
        if client is None:
            reply = httpx.post(f"{url}/v3/kv/range", json=body, timeout=2)
        else:
            reply = client.post(f"{url}/v3/kv/range", json=body, timeout=2)
    except httpx.HTTPError:
        return {}
    return {base64.b64decode(kv["key"]).decode(): base64.b64decode(kv.get("value", ""))
            for kv in reply.json().get("kvs", [])}


def _spawn_here(argv: Sequence[str], log_path: Path | None) -> subprocess.Popen[bytes]:
    return process.spawn(argv, log_path=log_path)


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("no `etcd` binary on PATH; install it (Debian/Ubuntu: "
                           "`sudo apt-get install etcd-server`) or pass --etcd URL")
    return path


class LocalEtcd:
    def __init__(self, log_path: Path | None = None, tls: TlsFiles | None = None,
                 extra_args: Sequence[str] = (), host: str = "127.0.0.1",
                 spawn: Spawn = _spawn_here) -> None:
        """``extra_args``: more of etcd's own flags (tests: ``--auth-token-ttl``)."""
        self._binary = etcd_binary()
        self.host = host
        self._spawn = spawn
        self._extra_args = tuple(extra_args)
        # (cert, key, ca) as absolute paths (etcd runs in its own directory), and the
        # health check's client context; None: plaintext
        self._files = _tls_paths(tls) if tls is not None else None
        self._health_tls = TlsFiles(*self._files).ssl_context(server=False) if self._files else None
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdserve-etcd-"))
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{self._scheme}://{self.host}:{self.client_port}"

    @property
    def _scheme(self) -> str:
        return "https" if self._files else "http"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalEtcd:
        peer = f"{self._scheme}://{self.host}:{self.peer_port}"
        argv = [self._binary, "--name", "pdserve", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"pdserve={peer}", *self._tls_flags(), *self._extra_args]
        self.proc = self._spawn(argv, self._log_path)
        self._wait_healthy(timeout_s)
        return self

    def _tls_flags(self) -> list[str]:
        if self._files is None:
            return []
        cert, key, ca = self._files
        return ["--cert-file", cert, "--key-file", key, "--trusted-ca-file", ca,
                "--client-cert-auth", "--peer-cert-file", cert, "--peer-key-file", key,
                "--peer-trusted-ca-file", ca, "--peer-client-cert-auth"]

    def _wait_healthy(self, timeout_s: float) -> None:
        """``RuntimeError`` (``NotReadyError``) if etcd exits first, or is not healthy
        within ``timeout_s``; then it is stopped and its data directory removed (no
        ``with`` block exits for a start that failed, so nothing else would)."""
        try:
            process.wait_ready(self._health, timeout_s, exited=self._exited, interval_s=0.1)
        except process.NotReadyError as exc:
            self.stop()
            raise process.NotReadyError(f"etcd {exc}") from None

    def _health(self) -> str:
        verify: ssl.SSLContext | bool = self._health_tls or True
        reply = httpx.get(self.url + "/health", timeout=1, verify=verify).json()
        return "" if reply.get("health") == "true" else f"health {reply}"

    def _exited(self) -> str | None:
        assert self.proc is not None
        rc = self.proc.poll()
        return None if rc is None else f"exit code {rc} (data dir {self.data_dir})"

    def stop(self, *, keep_data: bool = False, sig: int = signal.SIGKILL) -> None:
        """``sig`` (SIGKILL: as if it crashed) to etcd's group, SIGKILL after 10 s; the
        data directory is removed unless ``keep_data``."""
        if self.proc is not None and self.proc.poll() is None:
            process.stop([self.proc], grace_s=10, sig=sig)
        self.proc = None
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _tls_paths(tls: TlsFiles) -> tuple[str, str, str]:
    if not (tls.cert and tls.key and tls.ca):
        raise ValueError("a TLS etcd needs --tls-cert, --tls-key and --tls-ca (it requires "
                         "client certificates)")
    return (str(Path(tls.cert).resolve()), str(Path(tls.key).resolve()),
            str(Path(tls.ca).resolve()))
