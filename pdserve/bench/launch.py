"""Start a ``SystemSpec``'s processes, wait until it serves, stop it and prove it gone.

Each process runs in its own session, so a stop reaches everything it started
(vLLM's EngineCore, pdserve up's workers: up stops its own, which run in their
sessions): SIGTERM to the group, a deadline, SIGKILL. Every process seen in the
system's trees before the stop is then checked with psutil; any still alive is
killed and reported as left behind, and the system's port must be free again.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from pdserve.bench.systems import SystemSpec

WARM_PROMPT = "Say hello."


class StartupError(RuntimeError):
    """The system did not serve within its deadline (or a process of it exited)."""


@dataclass
class StopReport:
    """How a system went away: cleanly (every process gone after SIGTERM), or not."""

    clean: bool = True
    killed: list[str] = field(default_factory=list)  # needed SIGKILL after the grace
    left_behind: list[str] = field(default_factory=list)  # alive even after SIGKILL
    port_free: bool = True

    def to_json(self) -> dict[str, object]:
        return {"clean": self.clean, "killed": self.killed, "left_behind": self.left_behind,
                "port_free": self.port_free}


class RunningSystem:
    """A started system. Use as a context manager: it is always stopped on exit."""

    def __init__(self, spec: SystemSpec, log_dir: Path, stop_grace_s: float = 60.0) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_report: StopReport | None = None

    def __enter__(self) -> RunningSystem:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        for p in self.spec.procs:
            with open(self.log_dir / f"{p.name}.log", "wb") as log:
                self.procs[p.name] = subprocess.Popen(
                    p.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    env={**os.environ, **p.env}, start_new_session=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def exited(self) -> str | None:
        """A description of the first process that has exited, or None."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                return f"{name} exited with {proc.returncode} (log {self.log_dir / name}.log)"
        return None

    def wait_ready(self, timeout_s: float) -> float:
        """Until ``/v1/models`` lists the model and one short chat request completes (and
        for pdserve, its router sees every worker healthy: a prefill worker still loading
        would leave the first requests to decode alone). Returns the seconds it took;
        raises ``StartupError`` at the deadline."""
        started = time.monotonic()
        deadline = started + timeout_s
        last = "no answer yet"
        with httpx.Client(base_url=self.spec.base_url, timeout=10.0) as client:
            while time.monotonic() < deadline:
                gone = self.exited()
                if gone:
                    raise StartupError(gone)
                try:
                    last = _probe(client, deadline) or (
                        _all_workers_healthy(client) if self.spec.kind == "pdserve" else "")
                    if not last:
                        return time.monotonic() - started
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                time.sleep(1.0)
        raise StartupError(f"not serving after {timeout_s:.0f} s ({last})")

    def stop(self) -> StopReport:
        if self.stop_report is not None:
            return self.stop_report
        report = StopReport()
        tree = self._tree()
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.stop_grace_s
        _wait_gone(tree, deadline)
        for p in tree:
            if _alive(p):
                report.clean = False
                report.killed.append(_describe(p))
        for proc in self.procs.values():
            _signal_group(proc.pid, signal.SIGKILL)
        for p in tree:
            if _alive(p):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.kill()
        _wait_gone(tree, time.monotonic() + 10.0)
        for proc in self.procs.values():
            proc.wait(timeout=10.0)  # reaped: a zombie holds no port but psutil sees it
        report.left_behind = [_describe(p) for p in tree if _alive(p)]
        report.port_free = port_free(self.spec.port)
        self.stop_report = report
        return report

    def _tree(self) -> list[psutil.Process]:
        """Every live process of the system: each started process and its descendants
        (``pdserve up``'s workers too: they are up's children, in their own sessions)."""
        tree: list[psutil.Process] = []
        for proc in self.procs.values():
            try:
                root = psutil.Process(proc.pid)
                tree += [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                continue
        return tree


def _probe(client: httpx.Client, deadline: float) -> str:
    """'' once serving, else what is missing."""
    models = client.get("/v1/models")
    if models.status_code != 200:
        return f"/v1/models: HTTP {models.status_code}"
    ids = [m.get("id") for m in models.json().get("data", [])]
    if not ids:
        return "/v1/models lists no model"
    timeout = max(1.0, min(120.0, deadline - time.monotonic()))
    warm = client.post("/v1/chat/completions", timeout=timeout, json={
        "model": ids[0], "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": WARM_PROMPT}]})
    return "" if warm.status_code == 200 else f"warm request: HTTP {warm.status_code}"


def _all_workers_healthy(client: httpx.Client) -> str:
    """'' once the router's ``/workers`` lists workers, all healthy; else who is not."""
    reply = client.get("/workers")
    try:
        workers = reply.json().get("workers", []) if reply.status_code == 200 else []
    except ValueError:
        workers = []
    waiting = [str(w.get("id")) for w in workers if not w.get("healthy")]
    if not workers:
        return "/workers lists no worker"
    return f"workers not healthy yet: {', '.join(waiting)}" if waiting else ""


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_gone(tree: list[psutil.Process], deadline: float) -> None:
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline()[:6])}"
    except psutil.Error:
        return f"pid {p.pid}"
