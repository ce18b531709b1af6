"""``pdserve up``'s children: what each is (``Child``), whether it is ready (its
gRPC Health, or the router's view of its workers). ``pdserve up``
runs its children under ``pdserve.launch.supervisor``.
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from rich.console import Console

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls
from pdserve.router.dispatch.workers.client import WorkerCallError, probe_health

STOP_GRACE_S = 15.0
console = Console(stderr=True)


@functools.cache
def _probes() -> httpx.Client:
    """One client for every HTTP probe: ``httpx.get`` builds a client (and its TLS
    context) per call, ~20 ms of CPU, which polling children that are still starting takes
    from them. No keep-alive: each probe opens its own connection (a restarted router
    leaves no stale one). Only the thread that drives ``ClusterWatch`` probes."""
    return httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


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
        reply = _probes().get(child.probe, timeout=1, headers=child.probe_headers)
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


def tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of the log at ``path`` ("" where it cannot be read): what
    a process printed before it exited (``pdserve up``, the micro-benchmarks)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
