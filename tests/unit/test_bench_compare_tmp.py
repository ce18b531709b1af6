"""``pdserve bench compare`` gives the processes it starts a temporary folder of their
own for vLLM's ZMQ sockets and rendezvous file (``VLLM_RPC_BASE_PATH``, ``TMPDIR``) and
removes it when it stops them, killed or not: a ``vllm serve`` baseline leaves both in
``/tmp`` otherwise; a start that fails halfway stops what it started and removes it too.
A stand-in process writes where vLLM would."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import pytest

from pdserve.bench.compare.launch import RunningSystem
from pdserve.bench.compare.systems import ProcSpec, SystemSpec
from pdserve.core.ports import free_port

# What vLLM does with the two variables: a socket file under one, a rendezvous file
# under the other (tempfile reads TMPDIR); then it serves until stopped.
_ENGINE = """
import os, pathlib, tempfile, time
pathlib.Path(os.environ["VLLM_RPC_BASE_PATH"], "socket").write_text("")
pathlib.Path(tempfile.gettempdir(), "vllm_dist_x").write_text("")
print(os.environ["VLLM_RPC_BASE_PATH"], tempfile.gettempdir(), flush=True)
time.sleep(600)
"""


def _spec(env: dict[str, str], *more: ProcSpec) -> SystemSpec:
    proc = ProcSpec("vllm", (sys.executable, "-c", _ENGINE), env)
    return SystemSpec("vllm", "vllm", free_port(), (proc, *more), {"engine": "0"})


def _wait_for_line(running: RunningSystem, log: Path) -> list[str]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and running.exited() is None:
        words = log.read_text().split()
        if len(words) == 2:
            return words
        time.sleep(0.05)
    raise AssertionError(f"the stand-in engine: {running.exited()}: {log.read_text()!r}")


def test_vllms_files_go_to_the_systems_own_folder_and_it_is_gone_after_stop(
        tmp_path: Path) -> None:
    with RunningSystem(_spec({}), tmp_path / "logs", stop_grace_s=5) as running:
        rpc, tmp = _wait_for_line(running, tmp_path / "logs" / "vllm.log")
        folder = Path(rpc)
        assert tmp == rpc and folder == running.tmp_dir
        assert folder.parent == Path(tempfile.gettempdir())  # short: a socket's path
        assert sorted(p.name for p in folder.iterdir()) == ["socket", "vllm_dist_x"]
    assert running.stop_report is not None and running.stop_report.clean
    assert not folder.exists()


def test_a_folder_the_spec_names_wins(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    mine.mkdir()
    env = {"VLLM_RPC_BASE_PATH": str(mine), "TMPDIR": str(mine)}
    with RunningSystem(_spec(env), tmp_path / "logs", stop_grace_s=5) as running:
        rpc, tmp = _wait_for_line(running, tmp_path / "logs" / "vllm.log")
        assert rpc == tmp == str(mine)
        own = running.tmp_dir
    assert own is not None and not own.exists()
    assert sorted(p.name for p in mine.iterdir()) == ["socket", "vllm_dist_x"]


def test_a_start_that_fails_halfway_stops_what_it_started_and_removes_the_folder(
        tmp_path: Path) -> None:
    missing = ProcSpec("router", (str(tmp_path / "no-such-launcher"),), {})
    running = RunningSystem(_spec({}, missing), tmp_path / "logs", stop_grace_s=5)
    with pytest.raises(OSError):
        running.__enter__()
    started = running.procs["vllm"]
    assert started.poll() is not None  # stopped, not left serving
    assert running.tmp_dir is not None and not running.tmp_dir.exists()
    assert running.stop_report is not None


def test_a_pdserve_systems_up_logs_into_compares_folder(tmp_path: Path) -> None:
    """Its children's logs (up's --log-dir, through PDSERVE_LOG_DIR) go beside up's own
    log in the run's folder, not into the user's <cache>/logs."""
    engine = "import os, time; print(os.environ['PDSERVE_LOG_DIR'], 'x', flush=True); " \
             "time.sleep(600)"
    proc = ProcSpec("pdserve-up", (sys.executable, "-c", engine), {})
    spec = SystemSpec("pd", "pdserve", free_port(), (proc,), {"engine": "0"})
    with RunningSystem(spec, tmp_path / "logs", stop_grace_s=5) as running:
        folder, _ = _wait_for_line(running, tmp_path / "logs" / "pdserve-up.log")
    assert Path(folder) == tmp_path / "logs" / "pdserve-up-logs"
