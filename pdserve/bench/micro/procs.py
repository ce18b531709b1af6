"""A fixed set of pdserve processes (workers, routers, sim workers) for one bench:
started, polled until each is ready and stopped with ``pdserve.core.process``, the one
process mechanism. Fail-fast: a process that exits before it is ready ends the wait."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls
from pdserve.launch.up_children import tail
from pdserve.router.dispatch.workers.client import WorkerCallError, probe_health

STOP_GRACE_S = 15.0
# Every process's environment, added to this one's: offline hub, unbuffered logs.
CHILD_ENV = {"HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class Proc:
    """One process: its argv, its log, and how to see it ready (``grpc:host:port``: the
    worker's Health says ready; ``http://...``: that URL answers 200)."""

    name: str
    argv: tuple[str, ...]
    log: Path
    probe: str
    tls: GrpcTls | None = field(default=None, repr=False)  # a worker that serves TLS
    secret: ClusterSecret | None = field(default=None, repr=False)  # one that needs it


def probe(p: Proc) -> str:
    """'' once ``p`` is ready, else what it is waiting for."""
    if p.probe.startswith("grpc:"):
        try:
            health = probe_health(p.probe.removeprefix("grpc:"), timeout_s=1,
                                  secret=p.secret, tls=p.tls)
        except WorkerCallError:
            return "no answer"
        return "" if health.ready else "loading engine"
    try:
        status = httpx.get(p.probe, timeout=1).status_code
    except httpx.HTTPError:
        return "no answer"
    return "" if status == 200 else f"HTTP {status}"


class ProcGroup:
    """Processes started in the order given and stopped in reverse (a router before its
    workers: no new requests while they drain). Use as a context manager."""

    def __init__(self, procs: list[Proc], grace_s: float = STOP_GRACE_S) -> None:
        self.specs = procs
        self.grace_s = grace_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self._ready: set[str] = set()

    def __enter__(self) -> ProcGroup:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for p in self.specs:
            p.log.parent.mkdir(parents=True, exist_ok=True)
            p.log.write_bytes(b"")  # this run's log only
            self.procs[p.name] = process.spawn(p.argv, log_path=p.log, env=CHILD_ENV)

    def pid(self, name: str) -> int:
        return self.procs[name].pid

    def _exited(self) -> str | None:
        for p in self.specs:
            rc = self.procs[p.name].poll()
            if rc is not None:
                return f"{p.name} exited ({rc}); see {p.log}:\n{tail(p.log)}"
        return None

    def _probe(self) -> str:
        waiting = []
        for p in self.specs:
            if p.name in self._ready:
                continue
            why = probe(p)
            if why:
                waiting.append(f"{p.name}: {why}")
            else:
                self._ready.add(p.name)
        return "; ".join(waiting)

    def wait_ready(self, timeout_s: float) -> float:
        """Until every process is ready; raises ``process.NotReadyError`` past the
        deadline or once one of them has exited. Returns the seconds it took."""
        return process.wait_ready(self._probe, timeout_s, exited=self._exited)

    def stop(self) -> process.StopReport:
        live = [self.procs[p.name] for p in reversed(self.specs) if p.name in self.procs]
        self.procs = {}
        self._ready.clear()
        return process.stop(live, self.grace_s)
