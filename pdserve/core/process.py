"""The one way pdserve starts and stops a process: spawn it in its own session (so a
signal reaches its whole group: a worker and its vLLM engine processes), poll it until
it is ready, stop it with a grace (SIGTERM to the group, a deadline, SIGKILL), reap it.

Every launcher uses this: ``Supervisor`` (``pdserve up``'s children), bench's systems,
the local etcd and the bench scripts. A stop also finds what a process started in
sessions of its own (``pdserve up``'s workers are up's children, each in its own
session) and stops those with it, so nothing outlives its launcher.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

REAP_TIMEOUT_S = 10.0
_POLL_S = 0.1


class NotReadyError(RuntimeError):
    """A process was not ready within its deadline, or exited first; the message
    says what was missing last (the probe's own words)."""


def spawn(argv: Sequence[str], *, log_path: Path | None = None,
          env: Mapping[str, str] | None = None, cwd: Path | None = None,
          base_env: Mapping[str, str] | None = None, pipe_stdout: bool = False
          ) -> subprocess.Popen[bytes]:
    """Start ``argv`` in a session of its own (its pid is its group's id), stdin
    closed, stdout and stderr to ``log_path`` (appended) or discarded; with
    ``pipe_stdout`` stdout is a pipe the caller reads (``proc.stdout``) and only stderr
    goes to the log. ``env`` is added to ``base_env`` (this process's environment by
    default). The caller owns the process: ``stop`` it."""
    out = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL  # noqa: SIM115
    base = os.environ if base_env is None else base_env
    try:
        return subprocess.Popen(list(argv), stdout=subprocess.PIPE if pipe_stdout else out,
                                stderr=out if pipe_stdout else subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd,
                                env={**base, **(env or {})}, start_new_session=True)
    finally:
        if not isinstance(out, int):  # our log file, not DEVNULL
            out.close()  # the child holds its own copy


def signal_group(pid: int, sig: int) -> None:
    """``sig`` to the group ``pid`` leads; a group already gone is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def wait_ready(probe: Callable[[], str], timeout_s: float, *,
               exited: Callable[[], str | None] = lambda: None, interval_s: float = 0.5,
               retry_on: tuple[type[Exception], ...] = (Exception,),
               clock: Callable[[], float] = time.monotonic,
               sleep: Callable[[float], None] = time.sleep) -> float:
    """Poll ``probe`` (``''`` once ready, else what is missing; an exception of
    ``retry_on`` counts as not ready and names itself, any other propagates) until it
    is ready; returns the seconds it took. ``exited`` says why the process can no
    longer become ready (``None`` while it can). Raises ``NotReadyError`` past
    ``timeout_s`` or once ``exited`` answers."""
    start = clock()
    last = "no answer yet"
    while True:
        gone = exited()
        if gone is not None:
            raise NotReadyError(f"exited before it was ready ({last}): {gone}")
        try:
            last = probe()
        except retry_on as exc:
            last = f"{type(exc).__name__}: {exc}"
        if not last:
            return clock() - start
        if clock() - start >= timeout_s:
            raise NotReadyError(f"not ready after {timeout_s:.0f} s ({last})")
        sleep(interval_s)


@dataclass
class StopReport:
    """How processes went away: cleanly (all gone within the grace), or not."""

    clean: bool = True
    killed: list[str] = field(default_factory=list)  # needed SIGKILL after the grace
    left_behind: list[str] = field(default_factory=list)  # alive even after SIGKILL


def stop(procs: Sequence[subprocess.Popen[bytes]], grace_s: float,
         sig: int = signal.SIGTERM) -> StopReport:
    """``sig`` (SIGTERM) to every process's group, in the order given; SIGKILL whatever
    of them or their descendants (in any session) is alive after ``grace_s``, then reap
    them. Returns what needed the SIGKILL and what survived it; never raises.

    A process already reaped (``returncode`` set) is skipped: its pid, and so its
    group's id, may belong to another process by now. The others stay unreaped (a
    zombie keeps its pid and group id) until the group SIGKILL has been sent."""
    report = StopReport()
    procs = [proc for proc in procs if proc.returncode is None]
    tree = descendants_and_self(procs)
    for proc in procs:
        signal_group(proc.pid, sig)
    _wait_gone(tree, time.monotonic() + grace_s)
    report.killed = [_describe(p) for p in tree if _alive(p)]
    report.clean = not report.killed
    for proc in procs:
        signal_group(proc.pid, signal.SIGKILL)
    for p in tree:
        if _alive(p):
            with contextlib.suppress(psutil.Error):
                p.kill()
    _wait_gone(tree, time.monotonic() + REAP_TIMEOUT_S)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=REAP_TIMEOUT_S)  # reaped: a zombie holds its pid
    report.left_behind = [_describe(p) for p in tree if _alive(p)]
    return report


def owner_alive(pid: int, started: float) -> bool:
    """Whether ``pid`` still runs, and is the process that started at ``started`` (its
    ``create_time``): a slot's owner in a file processes share (``/dev/shm``)."""
    try:
        process = psutil.Process(pid)
        return (process.status() != psutil.STATUS_ZOMBIE
                and abs(process.create_time() - started) < 0.05)
    except psutil.Error:
        return False


def descendants_and_self(procs: Sequence[subprocess.Popen[bytes]]) -> list[psutil.Process]:
    """Every live process among ``procs`` and their descendants (any session)."""
    tree: list[psutil.Process] = []
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            root = psutil.Process(proc.pid)
            tree += [root, *root.children(recursive=True)]
    return tree


def _wait_gone(tree: list[psutil.Process], deadline: float) -> None:
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in tree):  # a zombie is gone: _alive says so
            return
        time.sleep(_POLL_S)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"pid {p.pid} {' '.join(p.cmdline()[:6])}"
    except psutil.Error:
        return f"pid {p.pid}"
