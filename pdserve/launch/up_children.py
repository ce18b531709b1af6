"""``pdserve up``'s children: what each is (``Child``), whether it is ready (its
gRPC Health, or the router's view of its workers), a status table, and the
fail-fast start/stop that the benchmarks use for fixed sets of processes
(``pdserve up`` itself runs its children under ``pdserve.launch.supervisor``).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls
from pdserve.router.dispatch.worker_client import WorkerCallError, probe_health

STOP_GRACE_S = 15.0
console = Console(stderr=True)


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    probe: str  # "grpc:host:port", "http://.../health" or "http://.../workers" (all routable)
    proc: subprocess.Popen[bytes] | None = None
    state: str = "starting"
    extra: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # added to the child's environment
    probe_headers: dict[str, str] = field(default_factory=dict)  # the router's API key
    # The router's last /workers answer: how many workers (of which decode) it finds healthy.
    num_healthy: int = 0
    num_healthy_decode: int = 0


def child_env() -> dict[str, str]:
    """Every child's environment: offline hub, unbuffered logs."""
    return dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")


def probe_child(child: Child, secret: ClusterSecret | None = None,
                tls: GrpcTls | None = None) -> bool:
    """Whether ``child`` is ready (and its ``state`` text); never raises, ~1 s at most.
    A worker is probed with the cluster's secret and TLS, as the router calls it."""
    if child.probe.startswith("grpc:"):
        target = child.probe.removeprefix("grpc:")
        try:
            health = probe_health(target, timeout_s=1, secret=secret, tls=tls)
        except WorkerCallError:
            return False
        child.state = "ready" if health.ready else "loading engine"
        return bool(health.ready)
    try:
        reply = httpx.get(child.probe, timeout=1, headers=child.probe_headers)
        ok = reply.status_code == 200
        if ok and child.probe.endswith("/workers"):  # every worker found and healthy
            healthy = [w for w in reply.json()["workers"] if w["healthy"]]
            child.num_healthy = len(healthy)
            child.num_healthy_decode = sum(1 for w in healthy if w["role"] == "decode")
            ok = child.num_healthy >= int(child.extra["num_workers"])
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    child.state = "ready" if ok else "waiting for workers"
    return ok


def _table(children: list[Child], started: float) -> Table:
    table = Table(title=f"pdserve starting ({time.monotonic() - started:.0f}s)")
    table.add_column("component")
    table.add_column("state")
    table.add_column("log")
    for c in children:
        table.add_row(c.name, c.state, str(c.log))
    return table


def start_children(children: list[Child]) -> None:
    """Spawn every child in its own session (``pdserve.core.process``), its log fresh."""
    env = child_env()
    for child in children:
        child.log.parent.mkdir(parents=True, exist_ok=True)
        child.log.write_bytes(b"")
        child.proc = process.spawn(child.argv, log_path=child.log, env=child.env, base_env=env)


def stop_children(children: list[Child], grace_s: float = STOP_GRACE_S) -> process.StopReport:
    """SIGTERM every child's process group (the router first: no new requests while
    workers drain), SIGKILL what is left of them and their descendants after
    ``grace_s``, reap them."""
    return process.stop([c.proc for c in reversed(children) if c.proc is not None], grace_s)


def wait_ready(children: list[Child], timeout_s: float,
               secret: ClusterSecret | None = None, tls: GrpcTls | None = None) -> None:
    """Until every child is ready (``probe_child``), showing their states.
    ``NotReadyError`` (a ``RuntimeError``) once one exits, or after ``timeout_s``."""
    started = time.monotonic()
    with Live(_table(children, started), console=console, refresh_per_second=2) as live:

        def exited() -> str | None:
            for child in children:
                assert child.proc is not None
                if child.proc.poll() is not None:
                    child.state = f"exited ({child.proc.returncode})"
                    live.update(_table(children, started))
                    return f"{child.name} {child.state}; see {child.log}:\n{tail(child.log)}"
            return None

        def probe() -> str:
            for child in children:
                if child.state != "ready":
                    probe_child(child, secret, tls)
            live.update(_table(children, started))
            return ", ".join(f"{c.name} {c.state}" for c in children if c.state != "ready")

        process.wait_ready(probe, timeout_s, exited=exited, interval_s=0.5)


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
