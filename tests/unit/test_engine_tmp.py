"""The engine's own temporary folder (``worker/engine_tmp.py``): vLLM's IPC sockets and
rendezvous file go there, it goes when its worker exits, and a killed worker's folder
goes at the next worker's start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from pdserve.worker.engine_tmp import PREFIX, sweep_dead

_CHILD = textwrap.dedent("""
    import os, sys, tempfile
    from pathlib import Path
    from pdserve.worker.engine_tmp import engine_tmp_dir
    folder = engine_tmp_dir(Path(sys.argv[1]))
    (folder / "sock").write_text("x")  # what vLLM would leave there
    # what the engine's child processes see
    child = {k: os.environ[k] for k in ("VLLM_RPC_BASE_PATH", "TMPDIR")}
    print(folder, child["VLLM_RPC_BASE_PATH"], child["TMPDIR"], flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), 9)
""")


def _run(base: Path, how: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(base), how], text=True,
                          capture_output=True, timeout=60, env=dict(os.environ))
    folder, rpc, tmp = proc.stdout.split()
    assert rpc == tmp == folder and Path(folder).parent == base, proc.stdout
    return proc, Path(folder)


def test_the_folder_holds_vllms_files_and_goes_when_the_worker_exits(tmp_path: Path) -> None:
    proc, folder = _run(tmp_path, "exit")
    assert proc.returncode == 0, proc.stderr
    assert folder.name.startswith(PREFIX) and not folder.exists()


def test_a_killed_workers_folder_goes_at_the_next_start_and_a_live_ones_stays(
        tmp_path: Path) -> None:
    proc, killed = _run(tmp_path, "kill")
    assert proc.returncode == -9 and killed.exists()  # SIGKILL: no atexit
    mine = tmp_path / f"{PREFIX}{os.getpid()}-abc"  # a live worker's (this process)
    mine.mkdir()
    other = tmp_path / "vllm-something-else"
    other.mkdir()
    assert sweep_dead(tmp_path) == [killed]
    assert not killed.exists() and mine.exists() and other.exists()
