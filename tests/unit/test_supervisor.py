"""The supervisor behind ``pdserve up`` (``pdserve/launch/supervisor.py``) with cheap child
processes: a SIGKILLed child comes back after its back-off and is counted, one that
keeps failing is given up on, and neither a restart nor ``stop`` leaves a process
of a child's group behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
from pdserve_testing import wait_until

from pdserve.launch.supervisor import ChildEvent, ChildSpec, RestartPolicy, Supervisor

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
# A leader that spawns a grandchild into its own process group, as a worker spawns
# its vLLM engine, and prints the grandchild's pid.
WITH_GRANDCHILD = [sys.executable, "-c",
                   "import subprocess, time\n"
                   "p = subprocess.Popen(['sleep', '60'])\n"
                   "print(p.pid, flush=True)\n"
                   "time.sleep(60)"]
FAILING = [sys.executable, "-c", "import sys; sys.exit(3)"]
FAST = RestartPolicy(max_restarts=5, window_s=60, backoff_initial_s=0.2, backoff_max_s=0.8)


def _poll_until(sup: Supervisor, kind: str, timeout_s: float) -> list[ChildEvent]:
    """Poll (as ``pdserve up`` does) until an event of ``kind``; every event seen."""
    seen: list[ChildEvent] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen += sup.poll()
        if any(e.kind == kind for e in seen):
            return seen
        time.sleep(0.02)
    raise AssertionError(f"no {kind!r} event within {timeout_s}s; saw {seen}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _grandchild_pid(log: Path) -> int:
    text = wait_until(lambda: log.read_text().strip(), timeout_s=10)
    return int(text.splitlines()[-1])


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_initial_s=1, backoff_max_s=30)
    assert [policy.backoff_s(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, 30, 30]
    with pytest.raises(ValueError):
        RestartPolicy(max_restarts=-1)


def test_sigkilled_child_is_restarted_after_backoff_and_counted(tmp_path: Path) -> None:
    sup = Supervisor([ChildSpec("decode-0", SLEEPER, tmp_path / "d.log"),
                      ChildSpec("decode-1", SLEEPER, tmp_path / "d1.log")], FAST)
    sup.start()
    try:
        child, other = sup.children["decode-0"], sup.children["decode-1"]
        assert child.proc is not None and other.proc is not None
        first_pid, other_pid = child.proc.pid, other.proc.pid
        for n in (1, 2):  # the second failure waits twice as long
            killed = time.monotonic()
            os.kill(child.proc.pid, signal.SIGKILL)
            events = _poll_until(sup, "restarted", timeout_s=10)
            waited = time.monotonic() - killed
            (exited,) = [e for e in events if e.kind == "exited"]
            assert exited.name == "decode-0" and exited.returncode == -signal.SIGKILL
            assert exited.delay_s == pytest.approx(0.2 * 2 ** (n - 1))
            assert waited >= exited.delay_s
            assert child.num_restarts == n and child.running
        assert child.proc.pid != first_pid
        assert other.proc.pid == other_pid and other.num_restarts == 0  # untouched
        assert "restart 2 of decode-0" in (tmp_path / "d.log").read_text()
    finally:
        sup.stop(grace_s=5)


def test_child_failing_repeatedly_is_given_up(tmp_path: Path) -> None:
    policy = RestartPolicy(max_restarts=2, window_s=60, backoff_initial_s=0.05,
                           backoff_max_s=0.1)
    sup = Supervisor([ChildSpec("prefill-0", FAILING, tmp_path / "p.log")], policy)
    sup.start()
    try:
        events = _poll_until(sup, "gave_up", timeout_s=20)
        child = sup.children["prefill-0"]
        assert [e.kind for e in events] == ["exited", "restarted"] * 2 + ["gave_up"]
        assert child.gave_up and child.num_restarts == 2 and child.returncode == 3
        time.sleep(0.2)
        assert sup.poll() == [] and child.num_restarts == 2  # no more restarts
    finally:
        sup.stop(grace_s=5)


def test_failures_older_than_the_window_are_forgotten(tmp_path: Path) -> None:
    now = [0.0]
    policy = RestartPolicy(max_restarts=1, window_s=10, backoff_initial_s=0, backoff_max_s=0)
    sup = Supervisor([ChildSpec("router", FAILING, tmp_path / "r.log")], policy,
                     clock=lambda: now[0])
    sup.start()
    try:
        child = sup.children["router"]
        for step in range(3):  # one failure per 11 s: never two within the window
            assert child.proc is not None
            child.proc.wait(timeout=10)
            now[0] += 11
            kinds = [e.kind for e in sup.poll()]
            assert kinds == ["exited", "restarted"], (step, kinds)
        assert not child.gave_up and child.num_restarts == 3
    finally:
        sup.stop(grace_s=5)


def test_dead_leader_s_group_is_killed_before_the_restart(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    sup = Supervisor([ChildSpec("prefill-0", WITH_GRANDCHILD, log)], FAST)
    sup.start()
    try:
        orphan = _grandchild_pid(log)
        child = sup.children["prefill-0"]
        assert child.proc is not None
        os.kill(child.proc.pid, signal.SIGKILL)  # the worker dies, its "engine" does not
        _poll_until(sup, "exited", timeout_s=10)
        assert wait_until(lambda: not _alive(orphan), timeout_s=5), "the orphan survived"
    finally:
        sup.stop(grace_s=5)


def test_stop_leaves_no_process_of_any_group_behind(tmp_path: Path) -> None:
    ignores_term = [sys.executable, "-c",
                    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                    "print('ready', flush=True); time.sleep(60)"]
    specs = [ChildSpec("prefill-0", WITH_GRANDCHILD, tmp_path / "p.log"),
             ChildSpec("decode-0", ignores_term, tmp_path / "d.log"),
             ChildSpec("router", SLEEPER, tmp_path / "r.log")]
    sup = Supervisor(specs, FAST)
    sup.start()
    grandchild = _grandchild_pid(tmp_path / "p.log")
    wait_until(lambda: "ready" in (tmp_path / "d.log").read_text(), timeout_s=10)
    pids = [c.proc.pid for c in sup.children.values() if c.proc is not None]
    started = time.monotonic()
    sup.stop(grace_s=1)
    # The 1 s grace, then the kill: well under the children's 60 s sleep.
    assert time.monotonic() - started < 30
    assert not [p for p in [*pids, grandchild] if _alive(p)]
    assert sup.poll() == []  # stopping: nothing is restarted
