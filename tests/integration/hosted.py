"""Where a test cluster's processes run, and how the test reaches them: each process on
a host of its own (``pdserve.bench.hosts.HostNet``: network namespaces linked by a
router), or, where this machine cannot make hosts (not root), all on loopback, as before
hosts existed, with a warning that says why.

On hosts nothing of the cluster listens where the test's own process is: the test
reaches it from a client host (``call``: a thread of this process inside it; ``client``:
the calling thread inside it for a block; ``run``: a process there, and ``prober``: one
that answers gRPC ``GetLoad`` calls line by line, for gRPC, whose own threads would not
follow a thread into a host)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TypeVar

from pdserve.bench.hosts import PROBE_SCRIPT, HostNet, Prober, inside, unavailable
from pdserve.core import process
from pdserve.membership.local_etcd import LocalEtcd

T = TypeVar("T")
LINK_GBIT = 10.0
CLIENT = "client"
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
        """A host for ``name`` (its address; the one it has if it exists), or loopback."""
        if self.net is None:
            return "127.0.0.1"
        if name in self.net.hosts:
            return self.net.address(name)
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

    def client(self) -> contextlib.AbstractContextManager[None]:
        """The calling thread on the client host for the block (its sockets, and the
        threads it starts, are there; gRPC's are not: ``prober``)."""
        if self.net is None:
            return nullcontext()
        return inside(self.net.hosts[CLIENT].netns)

    def prober(self) -> Prober:
        return Prober(self._here([sys.executable, "-c", PROBE_SCRIPT]))

    def _here(self, argv: Sequence[str]) -> list[str]:
        return list(argv) if self.net is None else self.net.command(CLIENT, argv)

    def etcd(self, log_dir: Path) -> LocalEtcd:
        """An etcd on a host of its own (or loopback), healthy (``stop``, ``start``
        restart it there)."""
        name = "etcd"
        address = self.add(name)

        def spawn(argv: Sequence[str], log_path: Path | None) -> subprocess.Popen[bytes]:
            return self.spawn(name, argv, log_path or log_dir / "etcd.log", {})

        etcd = LocalEtcd(log_path=log_dir / "etcd.log", host=address, spawn=spawn)
        return self.call(etcd.start)


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
