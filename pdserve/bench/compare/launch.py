"""Start a ``SystemSpec``'s processes, wait until it serves, stop it and prove it gone.

Processes are started, polled and stopped the one way pdserve does it
(``pdserve.core.process``): each in its own session, so a stop reaches everything it
started (vLLM's EngineCore, pdserve up's workers, which run in sessions of their own):
SIGTERM to the group, a deadline, SIGKILL; any process of the system's trees still alive
after that is reported as left behind, and the system's port must be free again.

An external system (``--vllm-url``: running already, its operator's) is an
``ExternalSystem``: waited for as the others, never started, signalled or checked for its
port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from pdserve.bench.compare.systems import SystemSpec
from pdserve.core import process
from pdserve.worker.engine_tmp import vllm_tmp_env

WARM_PROMPT = "Say hello."
# Between readiness probes: a refused connection costs well under a millisecond on the
# one client, and every system start waits half this on average.
READY_POLL_S = 0.2


class StartupError(RuntimeError):
    """The system did not serve within its deadline (or a process of it exited)."""


@dataclass
class StopReport:
    """How a system went away: cleanly (every process gone after SIGTERM), or not
    (``pdserve.core.process.StopReport``), and whether its port is free again."""

    clean: bool = True
    killed: list[str] = field(default_factory=list)  # needed SIGKILL after the grace
    left_behind: list[str] = field(default_factory=list)  # alive even after SIGKILL
    port_free: bool | None = True  # None: not checked (an external system's)
    external: bool = False  # nothing was stopped: the system is not compare's

    @classmethod
    def of(cls, report: process.StopReport, port_free: bool) -> StopReport:
        return cls(report.clean, list(report.killed), list(report.left_behind), port_free)

    def to_json(self) -> dict[str, object]:
        return {"clean": self.clean, "killed": self.killed, "left_behind": self.left_behind,
                "port_free": self.port_free, "external": self.external}


class RunningSystem:
    """A started system. Use as a context manager: it is always stopped on exit.

    ``with RunningSystem(spec, log_dir) as running: running.wait_ready(600)`` ... then
    ``running.stop()`` (done on exit; a second call returns the first's report)."""

    def __init__(self, spec: SystemSpec, log_dir: Path, stop_grace_s: float = 60.0) -> None:
        self.spec = spec
        self.log_dir = log_dir
        self.stop_grace_s = stop_grace_s
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stop_report: StopReport | None = None
        self.tmp_dir: Path | None = None  # vLLM's sockets and rendezvous file, while it runs

    def __enter__(self) -> RunningSystem:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Each process of the spec, its output to ``log_dir/<name>.log``. A spawn that
        fails (a missing executable) stops the processes already started and removes the
        folder before the error goes on: ``__exit__`` never runs when ``__enter__`` raised."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # short (a socket's path has ~100 bytes): the system temporary folder, not log_dir
        self.tmp_dir = Path(tempfile.mkdtemp(prefix=f"pdserve-bench-{self.spec.kind}-"))
        own = vllm_tmp_env(self.tmp_dir)
        try:
            for p in self.spec.procs:
                log = self.log_dir / f"{p.name}.log"
                log.write_bytes(b"")  # a fresh log per start
                # pdserve up's children log beside it, not in the user's <cache>/logs
                logs = ({"PDSERVE_LOG_DIR": str(self.log_dir / f"{p.name}-logs")}
                        if self.spec.kind == "pdserve" else {})
                self.procs[p.name] = process.spawn(p.argv, log_path=log,
                                                   env={**own, **logs, **p.env})
        except BaseException:
            self.stop()
            raise

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
        raises ``StartupError`` at the deadline or once a process exits."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"

        def exited() -> str | None:
            gone = self.exited()
            if gone:
                raise StartupError(gone)
            return None

        def probe() -> str:
            nonlocal last
            try:
                last = _probe(client, deadline) or (
                    _all_workers_healthy(client) if self.spec.kind == "pdserve" else "")
            except (httpx.HTTPError, ValueError) as exc:  # not serving yet, and why
                last = f"{type(exc).__name__}: {exc}"
            return last

        with httpx.Client(base_url=self.spec.base_url, timeout=10.0) as client:
            try:
                return process.wait_ready(probe, timeout_s, exited=exited,
                                            interval_s=READY_POLL_S)
            except process.NotReadyError:
                raise StartupError(f"not serving after {timeout_s:.0f} s ({last})") from None

    def stop(self) -> StopReport:
        """Stop every process (``pdserve.core.process.stop``, ``stop_grace_s``) and check
        the port is free; once."""
        if self.stop_report is None:
            report = process.stop(list(self.procs.values()), self.stop_grace_s)
            self.stop_report = StopReport.of(report, port_free(self.spec.port))
            if self.tmp_dir is not None:
                shutil.rmtree(self.tmp_dir, ignore_errors=True)
        return self.stop_report


class ExternalSystem:
    """A system compare did not start (``spec.external``): ``RunningSystem``'s interface,
    but it starts nothing and its ``stop`` signals nothing and leaves its port alone."""

    def __init__(self, spec: SystemSpec) -> None:
        if not spec.external or spec.procs:
            raise ValueError(f"{spec.name}: not an external system")
        self.spec = spec

    def __enter__(self) -> ExternalSystem:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def exited(self) -> str | None:
        return None  # not ours to watch: a run against it that fails says why

    def wait_ready(self, timeout_s: float) -> float:
        """Until ``/v1/models`` lists the model and one short chat request completes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"

        def probe() -> str:
            nonlocal last
            try:
                last = _probe(client, deadline, self.spec.card.get("id"))
            except (httpx.HTTPError, ValueError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            return last

        with httpx.Client(base_url=self.spec.base_url, timeout=10.0) as client:
            try:
                return process.wait_ready(probe, timeout_s, interval_s=READY_POLL_S)
            except process.NotReadyError:
                raise StartupError(f"not serving after {timeout_s:.0f} s ({last})") from None

    def stop(self) -> StopReport:
        return StopReport(port_free=None, external=True)


def _probe(client: httpx.Client, deadline: float, model: str | None = None) -> str:
    """'' once serving ``model`` (default: the first listed), else what is missing."""
    models = client.get("/v1/models")
    if models.status_code != 200:
        return f"/v1/models: HTTP {models.status_code}"
    ids = [m.get("id") for m in models.json().get("data", [])]
    if not ids:
        return "/v1/models lists no model"
    if model is not None and model not in ids:
        return f"/v1/models does not list {model!r}"
    timeout = max(1.0, min(120.0, deadline - time.monotonic()))
    warm = client.post("/v1/chat/completions", timeout=timeout, json={
        "model": model or ids[0], "max_tokens": 2, "temperature": 0,
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
