"""A single-member etcd on loopback, for ``pdserve up --with-etcd`` and tests.

Runs the ``etcd`` binary (Debian: ``apt-get install etcd-server``) on free ports
with a temporary data directory; ``stop()`` kills it and removes the directory.
``stop(keep_data=True)`` then ``start()`` restarts it on the same ports and data.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
from pathlib import Path

import httpx

from pdserve.core import process
from pdserve.core.ports import free_port

START_TIMEOUT_S = 30.0


def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        raise RuntimeError("no `etcd` binary on PATH; install it (Debian/Ubuntu: "
                           "`sudo apt-get install etcd-server`) or pass --etcd URL")
    return path


class LocalEtcd:
    def __init__(self, log_path: Path | None = None) -> None:
        self._binary = etcd_binary()
        self.client_port = free_port()
        self.peer_port = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdserve-etcd-"))
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalEtcd:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [self._binary, "--name", "pdserve", "--data-dir", str(self.data_dir),
                "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", f"pdserve={peer}"]
        self.proc = process.spawn(argv, log_path=self._log_path)
        self._wait_healthy(timeout_s)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        """``RuntimeError`` (``NotReadyError``) if etcd exits first, or is not healthy
        within ``timeout_s`` (then it is stopped)."""
        try:
            process.wait_ready(self._health, timeout_s, exited=self._exited, interval_s=0.1)
        except process.NotReadyError as exc:
            if self.proc is not None and self.proc.poll() is None:
                self.stop()
            raise process.NotReadyError(f"etcd {exc}") from None

    def _health(self) -> str:
        reply = httpx.get(self.url + "/health", timeout=1).json()
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
