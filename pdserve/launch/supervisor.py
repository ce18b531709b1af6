"""Keeps a set of child processes running: ``pdserve up``'s workers and router.

A child that exits while the supervisor is not stopping is restarted with the same
argv and environment (so a worker comes back on the same ports and cores, and the
router's view of it follows once it is healthy again), after an exponential
back-off. A child that fails more than ``max_restarts`` times within ``window_s``
is given up on; the caller decides whether what remains can still serve.

Each child runs in its own session, so its process group holds what it spawned
(a worker's vLLM engine processes). When the leader dies, its group is SIGKILLed
before the restart: an orphaned engine would keep the KV port and its memory.
``stop`` SIGTERMs every group, then SIGKILLs what is left after a grace period
(``pdserve.core.process``: the one spawn and stop of every launcher).

The supervisor never sleeps or probes: the caller calls ``poll`` on its own
schedule (``pdserve up`` every half second) and acts on the events it returns.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.core import process

logger = logging.getLogger("pdserve.supervisor")

DEFAULT_MAX_RESTARTS = 5
DEFAULT_RESTART_WINDOW_S = 600.0


@dataclass(frozen=True)
class RestartPolicy:
    """Restart after ``backoff_initial_s``, doubling per recent failure up to
    ``backoff_max_s``; give up on the failure after ``max_restarts`` restarts
    within ``window_s`` (failures older than the window are forgotten)."""

    max_restarts: int = DEFAULT_MAX_RESTARTS
    window_s: float = DEFAULT_RESTART_WINDOW_S
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_restarts < 0:
            raise ValueError("max_restarts must be >= 0")
        if self.window_s <= 0 or self.backoff_initial_s < 0 or self.backoff_max_s < 0:
            raise ValueError("window_s must be > 0 and back-off times >= 0")

    def backoff_s(self, num_recent_failures: int) -> float:
        """The delay before the restart that follows the n-th recent failure (n >= 1)."""
        exponent = min(max(0, num_recent_failures - 1), 30)
        return min(self.backoff_max_s, self.backoff_initial_s * 2.0 ** exponent)


@dataclass(frozen=True)
class ChildSpec:
    name: str
    argv: Sequence[str]
    log: Path  # stdout and stderr; a restart appends to it
    env: Mapping[str, str] = field(default_factory=dict)  # on top of the supervisor's
    fresh_log: bool = True  # emptied at the first start (False: the log is shared, stderr)


@dataclass(frozen=True)
class ChildEvent:
    """What ``poll`` saw happen to one child."""

    name: str
    kind: str  # "exited" | "restarted" | "gave_up"
    returncode: int | None = None
    delay_s: float = 0.0  # "exited": when the restart is due
    num_restarts: int = 0


@dataclass
class SupervisedChild:
    spec: ChildSpec
    proc: subprocess.Popen[bytes] | None = None
    num_restarts: int = 0
    failures: deque[float] = field(default_factory=deque)  # monotonic times, within window
    restart_at: float | None = None  # set while waiting out the back-off
    gave_up: bool = False
    returncode: int | None = None  # of the last exit

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Supervisor:
    def __init__(self, specs: Sequence[ChildSpec], policy: RestartPolicy = RestartPolicy(),
                 env: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"child names must be unique: {names}")
        self.policy = policy
        self.children = {s.name: SupervisedChild(s) for s in specs}
        self._env = dict(env if env is not None else os.environ)
        self._clock = clock
        self._stopping = False

    def start(self) -> None:
        for child in self.children.values():
            self._spawn(child, first=True)

    def poll(self) -> list[ChildEvent]:
        """Notice exits (reap the group, schedule the restart or give up) and start
        the restarts that are due. Never blocks."""
        if self._stopping:
            return []
        events: list[ChildEvent] = []
        now = self._clock()
        for child in self.children.values():
            if child.gave_up:
                continue
            if child.restart_at is None and child.proc is not None \
                    and child.proc.poll() is not None:
                events.append(self._on_exit(child, now))
            if child.restart_at is not None and now >= child.restart_at:
                self._spawn(child, first=False)
                events.append(ChildEvent(child.spec.name, "restarted",
                                         num_restarts=child.num_restarts))
        return events

    def _on_exit(self, child: SupervisedChild, now: float) -> ChildEvent:
        assert child.proc is not None
        child.returncode = child.proc.returncode
        process.signal_group(child.proc.pid, signal.SIGKILL)  # what it left, e.g. an engine
        child.failures.append(now)
        while child.failures and now - child.failures[0] > self.policy.window_s:
            child.failures.popleft()
        name, rc = child.spec.name, child.returncode
        if len(child.failures) > self.policy.max_restarts:
            child.gave_up = True
            logger.error("%s exited (%s) %d times within %.0fs; giving up on it", name, rc,
                         len(child.failures), self.policy.window_s)
            return ChildEvent(name, "gave_up", rc, num_restarts=child.num_restarts)
        delay = self.policy.backoff_s(len(child.failures))
        child.restart_at = now + delay
        logger.warning("%s exited (%s); restarting in %.1fs", name, rc, delay)
        return ChildEvent(name, "exited", rc, delay, child.num_restarts)

    def _spawn(self, child: SupervisedChild, *, first: bool) -> None:
        spec = child.spec
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        if first and spec.fresh_log:
            spec.log.write_bytes(b"")
        else:
            child.num_restarts += 1
            with open(spec.log, "ab") as log:
                log.write(f"\n--- pdserve: restart {child.num_restarts} of {spec.name} "
                          f"(last exit {child.returncode}) ---\n".encode())
        child.proc = process.spawn(spec.argv, log_path=spec.log, env=spec.env,
                                   base_env=self._env)
        child.restart_at = None
        if not first:
            logger.info("%s restarted (restart %d, pid %d)", spec.name, child.num_restarts,
                        child.proc.pid)

    def stop(self, grace_s: float) -> process.StopReport:
        """SIGTERM every child's group (last started first: the router before its
        workers), then SIGKILL what is left of them and their descendants after
        ``grace_s`` (``pdserve.core.process.stop``); they are reaped on return."""
        self._stopping = True
        procs = [c.proc for c in self.children.values() if c.proc is not None]
        report = process.stop(procs[::-1], grace_s)
        for left in report.left_behind:
            logger.error("%s did not die after SIGKILL", left)
        return report
