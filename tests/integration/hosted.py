"""Where a test cluster's processes run, and how the test reaches them: each process on
a host of its own (``pdserve.bench.hosts.HostNet``: network namespaces linked by a
router), or, where this machine cannot make hosts (not root), all on loopback, as before
hosts existed, with a warning that says why.

On hosts nothing of the cluster listens where the test's own process is: the test
reaches it from a client host (``call``: a thread of this process inside it; ``run``: a
process there, for gRPC, whose own threads would not follow a thread into a host)."""

from __future__ import annotations

import shutil
import subprocess
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import httpx
from pdserve_testing import wait_until

from pdserve.bench.hosts import HostNet, unavailable
from pdserve.core import process
from pdserve.core.ports import free_port

T = TypeVar("T")
LINK_GBIT = 10.0
CLIENT = "client"
ETCD_START_S = 30.0


class Hosted:
    """The cluster's places (``add``), processes (``spawn``) and the test's reach
    (``call``, ``run``)."""

    def __init__(self, net: HostNet | None) -> None:
        self.net = net
        if net is not None:
            net.add(CLIENT, LINK_GBIT)

    @property
    def on_hosts(self) -> bool:
        return self.net is not None

    def add(self, name: str) -> str:
        """A host for ``name`` (its address), or loopback."""
        if self.net is None:
            return "127.0.0.1"
        return self.net.add(name, LINK_GBIT).address

    def spawn(self, name: str, argv: Sequence[str], log_path: Path,
              env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        log_path.write_bytes(b"")
        if self.net is None:
            return process.spawn(argv, log_path=log_path, env=env)
        return self.net.spawn(name, argv, log_path=log_path, env=env)

    def call(self, fn: Callable[[], T], where: str = CLIENT) -> T:
        """``fn()`` from the client host (or ``where``), or from here on loopback."""
        return fn() if self.net is None else self.net.call(where, fn)

    def run(self, argv: Sequence[str], timeout_s: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
        """``argv`` as a process on the client host (or here, on loopback)."""
        if self.net is None:
            return subprocess.run(list(argv), capture_output=True, text=True,
                                  timeout=timeout_s, check=False)
        return self.net.run(CLIENT, argv, timeout_s)

    def etcd(self, log_dir: Path) -> tuple[str, subprocess.Popen[bytes]]:
        """An etcd on a host of its own (or loopback), healthy: its client URL."""
        address = self.add("etcd")
        client, peer = free_port(), free_port()
        url, peer_url = f"http://{address}:{client}", f"http://{address}:{peer}"
        proc = self.spawn("etcd", [
            shutil.which("etcd") or "etcd", "--name", "pdserve", "--data-dir",
            str(log_dir / "etcd-data"), "--listen-client-urls", url, "--advertise-client-urls",
            url, "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"pdserve={peer_url}"], log_dir / "etcd.log", {})

        def healthy() -> bool:
            try:
                return bool(httpx.get(f"{url}/health", timeout=1).json().get("health") == "true")
            except (httpx.HTTPError, ValueError):
                return False

        assert wait_until(lambda: proc.poll() is not None or self.call(healthy),
                          ETCD_START_S, 0.2) is True, f"etcd not healthy: {log_dir}/etcd.log"
        return url, proc


@contextmanager
def hosted() -> Iterator[Hosted]:
    """Hosts where this machine can make them, else loopback (warned, with the reason)."""
    reason = unavailable()
    if reason:
        warnings.warn(f"the cluster runs on loopback, not on hosts: {reason}", stacklevel=2)
        yield Hosted(None)
        return
    with HostNet() as net:
        yield Hosted(net)
