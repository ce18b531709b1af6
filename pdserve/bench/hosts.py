"""Hosts on one machine: network namespaces linked by a router, each link with a rate.

``HostNet`` makes hosts for tests and benchmarks: every host is a network namespace of
its own with one interface (``eth0``, address ``10.77.N.2/24``, its loopback up) linked
to a router that lives in a switch namespace of its own (``10.77.N.1``: each host its
own subnet, the router forwards between them), and both directions of a host's link are
shaped by ``tc tbf`` to the rate it was given. Nothing is added to the
machine's own namespace: each veth pair is created with its two ends already inside
the namespaces. ``close`` kills every process left in a host and removes every
namespace (their interfaces go with them), whatever the caller did before;
``sweep`` removes what an owner killed before its ``close`` left behind (the names
carry the owner's pid).

Faults a network makes, each undone by ``heal``:

- ``cut(a, b)``: the router drops a's packets to b, silently (a ``blackhole`` rule in
  the switch: no error reaches either side, as with a switch that loses them): one way
  only, an asymmetric cut; ``both=True`` drops b's to a too, a partition of the two.
- ``isolate(a)``: the router drops every packet from a and to a (silently too): a
  reaches no host and no host reaches it, its link still up.

A frozen peer is a process matter (SIGSTOP), not the network's.

Needs root, iproute2's ``ip`` and ``tc`` with ``tbf``: ``unavailable()`` says what is
missing (the callers skip with that reason, never silently).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from multiprocessing import resource_tracker
from pathlib import Path
from typing import IO, TypeVar

from pdserve.core import process
from pdserve.core.types import KvLink, WorkerLoadReport

PREFIX = "pdh"  # every namespace this module makes: pdh<owner pid>-<tag>-<host>
NETWORK = "10.77"  # host N: 10.77.N.2, its router port 10.77.N.1
CALL_TIMEOUT_S = 10.0
# A token bucket deep enough for the rate (10 ms of it) and for one GSO/TSO segment
# (veth hands tbf segments of up to 64 KiB: a bucket below that drops them all).
MIN_BURST_BYTES = 256 * 1024
QUEUE_LATENCY = "50ms"  # how long a packet may wait in the bucket's queue
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


class HostNetError(RuntimeError):
    """An ``ip``/``tc`` call failed: its command line and what it printed."""


@dataclass(frozen=True)
class Host:
    name: str
    netns: str
    address: str
    port: str  # its link's name at the router, in the switch namespace
    rate_gbit: float | None  # None: not shaped


def _run(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(argv), capture_output=True, text=True, timeout=CALL_TIMEOUT_S,
                          check=False)
    if check and done.returncode != 0:
        raise HostNetError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done


def unavailable() -> str:
    """Why hosts cannot be made here ("" when they can): not root, no ``ip``/``tc``,
    no network namespaces or no ``tbf``."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe{uuid.uuid4().hex[:6]}"
    try:
        _run(["ip", "netns", "add", probe])
    except (HostNetError, OSError, subprocess.TimeoutExpired) as exc:
        return f"`ip netns add` failed: {exc}"
    try:
        _run(["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name",
              "b"])
        _run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "a", "root", "tbf",
              "rate", "1gbit", "burst", str(MIN_BURST_BYTES), "latency", QUEUE_LATENCY])
    except (HostNetError, subprocess.TimeoutExpired) as exc:
        return f"no veth pair or no tc tbf in a namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return ""


def enter(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (a name ``ip netns``
    knows): the sockets it opens from now on, and the threads and processes it starts,
    are there. (``os.setns`` from Python 3.12.)"""
    _setns(f"/run/netns/{netns}")


@contextlib.contextmanager
def inside(netns: str) -> Iterator[None]:
    """The calling thread in ``netns`` for the block, back where it was after."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        enter(netns)
        try:
            yield
        finally:
            _setns_fd(home)
    finally:
        os.close(home)


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _setns_fd(fd)
    finally:
        os.close(fd)


def _setns_fd(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def _namespaces() -> list[str]:
    done = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def _owner(netns: str) -> int | None:
    head = netns.removeprefix(PREFIX).split("-", 1)[0]
    return int(head) if netns.startswith(PREFIX) and head.isdigit() else None


def _remove(netns: str) -> None:
    """Kill what runs in ``netns`` (SIGKILL, reaped by its parent or init), then
    delete it."""
    deadline = time.monotonic() + CALL_TIMEOUT_S
    while time.monotonic() < deadline:
        pids = [int(p) for p in _run(["ip", "netns", "pids", netns], check=False).stdout.split()]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _run(["ip", "netns", "del", netns], check=False)


def sweep() -> list[str]:
    """Remove the namespaces of owners that are gone (killed before their ``close``);
    the names removed."""
    gone = []
    for netns in _namespaces():
        owner = _owner(netns)
        if owner is None or owner == os.getpid():
            continue
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            _remove(netns)
            gone.append(netns)
        except PermissionError:
            continue  # alive, someone else's
    return gone


def prepare_process() -> str:
    """Ready this process to work from hosts ("" when it can, else why not): it sweeps
    what killed runs left, turns SIGTERM into ``SystemExit`` (so that ``with HostNet()``
    blocks remove their hosts then too) and starts multiprocessing's resource tracker
    here (started from inside a host, it would die with it)."""
    if why := unavailable():
        return why
    sweep()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    resource_tracker.ensure_running()
    return ""


def _exit_on_sigterm(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


PROBE_SCRIPT = """import dataclasses, json, sys
from pdserve.router.dispatch.workers.client import probe_load
for line in sys.stdin:
    try:
        reply = {"load": dataclasses.asdict(probe_load(line.strip(), timeout_s=10))}
    except Exception as exc:  # noqa: BLE001 - handed to the caller
        reply = {"error": repr(exc)}
    print(json.dumps(reply), flush=True)"""
PROBE_S = 30.0


class Prober:
    """gRPC ``GetLoad`` from a process of its own (``HostNet.prober``: inside a host; gRPC's
    own threads would not follow a thread into one), asked one endpoint per line: started
    once, not once per call."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def load(self, endpoint: str, timeout_s: float = PROBE_S) -> WorkerLoadReport:
        """The worker's report; ``RuntimeError`` if the call failed or no answer came."""
        stdin, stdout = self._pipes()
        stdin.write(endpoint + "\n")
        stdin.flush()
        if not select.select([stdout], [], [], timeout_s)[0]:
            self.close()  # its answer would come to the next question
            raise RuntimeError(f"no GetLoad answer from {endpoint} in {timeout_s} s")
        reply = json.loads(stdout.readline() or '{"error": "prober exited"}')
        if "error" in reply:
            raise RuntimeError(f"GetLoad {endpoint}: {reply['error']}")
        load = reply["load"]
        return WorkerLoadReport(**{**load, "kv_links": tuple(KvLink(**link) for link in
                                                           load.get("kv_links", ()))})

    def _pipes(self) -> tuple[IO[str], IO[str]]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"the prober exited {self.proc.returncode}")
        return self.proc.stdin, self.proc.stdout

    @property
    def alive(self) -> bool:
        """Its process runs (one that timed out was closed: its answer would be late)."""
        return self.proc.poll() is None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


class HostNet:
    """Hosts on one router (see the module's docstring); a context manager."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:4]}"
        self.switch = f"{self.tag}-sw"
        self.hosts: dict[str, Host] = {}
        self._cuts: set[tuple[str, str]] = set()
        self._isolated: set[str] = set()
        _run(["ip", "netns", "add", self.switch])
        try:
            self._in(self.switch, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
            self._in(self.switch, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> HostNet:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def add(self, name: str, rate_gbit: float | None = None) -> Host:
        """A host linked to the router, its link shaped to ``rate_gbit`` each way (None: as
        fast as the machine copies)."""
        if name in self.hosts:
            raise ValueError(f"host {name} exists")
        index = len(self.hosts) + 1
        if index > 250:
            raise ValueError("at most 250 hosts on one router")
        host = Host(name, f"{self.tag}-{name}", f"{NETWORK}.{index}.2", f"p{index}", rate_gbit)
        _run(["ip", "netns", "add", host.netns])
        self.hosts[name] = host
        _run(["ip", "link", "add", "eth0", "netns", host.netns, "type", "veth", "peer", "name",
              host.port, "netns", self.switch])
        self._in(self.switch, "ip", "addr", "add", f"{NETWORK}.{index}.1/24", "dev", host.port)
        self._in(self.switch, "ip", "link", "set", host.port, "up")
        self._in(host.netns, "ip", "addr", "add", f"{host.address}/24", "dev", "eth0")
        self._in(host.netns, "ip", "link", "set", "eth0", "up")
        self._in(host.netns, "ip", "link", "set", "lo", "up")
        self._in(host.netns, "ip", "route", "add", "default", "via", f"{NETWORK}.{index}.1")
        if rate_gbit is not None:
            self.shape(name, rate_gbit)
        return host

    def shape(self, name: str, rate_gbit: float) -> None:
        """``name``'s link at ``rate_gbit`` each way (its egress, and the router's to it)."""
        host = self.hosts[name]
        bits = int(rate_gbit * 1e9)
        burst = max(MIN_BURST_BYTES, bits // 8 // 100)
        for netns, dev in ((host.netns, "eth0"), (self.switch, host.port)):
            self._in(netns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                     f"{bits}bit", "burst", str(burst), "latency", QUEUE_LATENCY)
        self.hosts[name] = replace(host, rate_gbit=rate_gbit)

    def address(self, name: str) -> str:
        return self.hosts[name].address

    def command(self, name: str, argv: Sequence[str]) -> list[str]:
        """``argv`` as run inside host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name].netns, *argv]

    def run(self, name: str, argv: Sequence[str], timeout_s: float = 60.0
            ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.command(name, argv), capture_output=True, text=True,
                              timeout=timeout_s, check=False)

    def spawn(self, name: str, argv: Sequence[str], *, log_path: Path | None = None,
              env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``argv`` started inside host ``name`` (``process.spawn``: a session of its
        own; ``ip netns exec`` execs it, so the pid is the command's)."""
        return process.spawn(self.command(name, argv), log_path=log_path, env=env)

    def call(self, name: str, fn: Callable[[], T], timeout_s: float = 300.0) -> T:
        """``fn()`` on a thread of this process inside host ``name``: the sockets it
        opens are that host's (a client of the cluster, from the caller's process)."""
        with concurrent.futures.ThreadPoolExecutor(
                1, initializer=enter, initargs=(self.hosts[name].netns,)) as pool:
            return pool.submit(fn).result(timeout=timeout_s)

    def prober(self, name: str) -> Prober:
        """A ``Prober`` inside host ``name`` (close it: ``Prober.close``)."""
        return Prober(self.command(name, [sys.executable, "-c", PROBE_SCRIPT]))

    def cut(self, a: str, b: str, both: bool = False) -> None:
        """The router drops a's packets to b (and b's to a with ``both``)."""
        for src, dst in ((a, b), (b, a)) if both else ((a, b),):
            if (src, dst) not in self._cuts:
                self._in(self.switch, "ip", "rule", "add", *self._rule(src, dst))
                self._cuts.add((src, dst))

    def isolate(self, name: str) -> None:
        if name not in self._isolated:
            for rule in self._isolation(name):
                self._in(self.switch, "ip", "rule", "add", *rule)
            self._isolated.add(name)

    def heal(self) -> None:
        """Every cut and isolation undone."""
        for src, dst in sorted(self._cuts):
            self._in(self.switch, "ip", "rule", "del", *self._rule(src, dst))
        self._cuts.clear()
        for name in sorted(self._isolated):
            for rule in self._isolation(name):
                self._in(self.switch, "ip", "rule", "del", *rule)
        self._isolated.clear()

    def namespaces(self) -> list[str]:
        return [self.switch, *(h.netns for h in self.hosts.values())]

    def close(self) -> None:
        """Kill every process still in a host, remove every namespace."""
        for netns in reversed(self.namespaces()):
            _remove(netns)
        self.hosts.clear()

    def _rule(self, src: str, dst: str) -> list[str]:
        return ["from", self.hosts[src].address, "to", self.hosts[dst].address, "blackhole"]

    def _isolation(self, name: str) -> list[list[str]]:
        address = self.hosts[name].address
        return [["from", address, "blackhole"], ["to", address, "blackhole"]]

    def _in(self, netns: str, *argv: str) -> None:
        _run(["ip", "netns", "exec", netns, *argv])
