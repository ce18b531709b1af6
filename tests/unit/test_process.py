"""The one process mechanism (``pdserve/core/process.py``): a spawn in its own session,
a stop that SIGTERMs, SIGKILLs after the grace, reaps and leaves no descendant (even
one in a session of its own), and the one readiness poller."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from pdserve.core import process

# Ignores SIGTERM and starts a grandchild in a session of its own (as ``pdserve up``
# starts its workers), then prints the grandchild's pid.
STUBBORN = ("import signal, subprocess, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            "p = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(60)")


class FakeClock:
    """A clock that only moves when slept on."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _printed(log: Path) -> str:
    """What the process logged, once it logged a line."""
    process.wait_ready(lambda: "" if log.read_text().endswith("\n") else "nothing yet", 10,
                       interval_s=0.02)
    return log.read_text().strip()


def test_spawn_runs_in_its_own_session_logging_with_its_env(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    log.write_text("earlier\n")
    script = ("import os, sys; print(os.getsid(0) == os.getpid(), os.environ['PDS_X'], "
              "os.environ.get('PDS_Y'), flush=True); print('err', file=sys.stderr)")
    proc = process.spawn([sys.executable, "-c", script], log_path=log, env={"PDS_X": "x"},
                         base_env={"PATH": os.environ.get("PATH", "")})
    assert proc.wait(timeout=30) == 0
    assert log.read_text().splitlines() == ["earlier", "True x None", "err"]  # appended
    piped = process.spawn([sys.executable, "-c", "print('out')"], pipe_stdout=True)
    out, _ = piped.communicate(timeout=30)
    assert out == b"out\n"


def test_stop_of_a_process_that_obeys_sigterm_is_clean() -> None:
    proc = process.spawn(["sleep", "60"])
    report = process.stop([proc], grace_s=10)
    assert proc.returncode == -signal.SIGTERM  # reaped
    assert report.clean and report.killed == [] and report.left_behind == []


def test_stop_kills_after_the_grace_and_leaves_no_descendant(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    sleeper = process.spawn(["sleep", "60"])
    stubborn = process.spawn([sys.executable, "-c", STUBBORN], log_path=log)
    grandchild = int(_printed(log))
    assert psutil.Process(grandchild).ppid() == stubborn.pid
    assert os.getsid(grandchild) != os.getsid(stubborn.pid)  # out of the group's reach
    started = time.monotonic()
    report = process.stop([sleeper, stubborn], grace_s=0.5)
    # The 0.5 s grace, then the kill: not less, and not the stubborn child's 60 s sleep.
    assert 0.5 <= time.monotonic() - started < 30
    assert sleeper.returncode == -signal.SIGTERM
    assert stubborn.returncode == -signal.SIGKILL  # it ignored the SIGTERM
    assert not report.clean and report.left_behind == []
    killed = {int(k.split()[1]) for k in report.killed}
    assert killed == {stubborn.pid, grandchild}, report.killed
    assert not _alive(grandchild)


def test_wait_ready_returns_the_time_it_took_once_the_probe_says_ready() -> None:
    clock = FakeClock()
    answers = iter(["loading", "loading", ""])
    took = process.wait_ready(lambda: next(answers), 10, interval_s=0.5, clock=clock,
                              sleep=clock.sleep)
    assert took == 1.0


def test_wait_ready_times_out_naming_what_was_missing_last() -> None:
    clock = FakeClock()

    def probe() -> str:
        raise ConnectionError("refused")  # an exception is "not ready yet"

    with pytest.raises(process.NotReadyError, match=r"not ready after 5 s \(ConnectionError"):
        process.wait_ready(probe, 5, interval_s=1, clock=clock, sleep=clock.sleep)
    assert clock.now == 5


def test_wait_ready_stops_once_the_process_exits() -> None:
    proc = process.spawn([sys.executable, "-c", "import sys; sys.exit(3)"])
    proc.wait(timeout=30)

    def exited() -> str | None:
        return None if proc.poll() is None else f"exit code {proc.returncode}"

    with pytest.raises(process.NotReadyError, match="exited before it was ready.*exit code 3"):
        process.wait_ready(lambda: "never", 60, exited=exited)


def test_wait_ready_lets_an_exception_outside_retry_on_through() -> None:
    def probe() -> str:
        raise KeyError("bug")

    with pytest.raises(KeyError):
        process.wait_ready(probe, 60, retry_on=(OSError,))
