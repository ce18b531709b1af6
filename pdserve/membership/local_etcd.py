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
import time
from pathlib import Path

import httpx

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
        log = open(self._log_path, "ab") if self._log_path else subprocess.DEVNULL  # noqa: SIM115
        try:
            self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            if self._log_path:
                log.close()  # type: ignore[union-attr]
        self._wait_healthy(timeout_s)
        return self

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode} at start "
                                   f"(data dir {self.data_dir})")
            try:
                if httpx.get(self.url + "/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"etcd not healthy after {timeout_s:.0f}s")

    def stop(self, *, keep_data: bool = False, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None
        if not keep_data:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
