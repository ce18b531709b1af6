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


_EVENTS_CHILD = textwrap.dedent("""
    import os, stat, sys, tempfile
    from pathlib import Path
    tempfile.tempdir = sys.argv[1]  # the system's temporary folder, for this worker
    from pdserve.worker.engine_tmp import engine_folder
    from pdserve.worker.vllm.kv_events import KvEventEndpoints
    folder = engine_folder()
    assert engine_folder() == folder  # chosen once
    events = KvEventEndpoints.for_worker("decode-0-1", folder)
    print(folder, oct(stat.S_IMODE(folder.stat().st_mode)), events.pub, events.replay,
          os.environ["VLLM_RPC_BASE_PATH"], flush=True)
""")


def test_the_kv_event_sockets_are_in_the_engines_own_folder_or_the_operators(
        tmp_path: Path) -> None:
    """They were named in the shared temporary folder, ``/tmp/pdserve-kvev-<id>-<pid>``,
    where another user could take the name first."""
    shared, chosen = tmp_path / "tmp", tmp_path / "operator"
    shared.mkdir()
    chosen.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "VLLM_RPC_BASE_PATH"}
    out = subprocess.run([sys.executable, "-c", _EVENTS_CHILD, str(shared)], text=True,
                         capture_output=True, timeout=60, env=env, check=True).stdout
    folder, mode, pub, replay, rpc = out.split()
    assert Path(folder).parent == shared and Path(folder).name.startswith(PREFIX)
    assert mode == "0o700" and rpc == folder
    assert (pub, replay) == (f"ipc://{folder}/pdserve-kvev-decode-0-1.pub",
                             f"ipc://{folder}/pdserve-kvev-decode-0-1.replay")
    assert list(shared.iterdir()) == []  # nothing in the shared folder, the folder gone
    out = subprocess.run([sys.executable, "-c", _EVENTS_CHILD, str(shared)], text=True,
                         capture_output=True, timeout=60, check=True,
                         env={**env, "VLLM_RPC_BASE_PATH": str(chosen)}).stdout
    folder, _, pub, _, rpc = out.split()
    assert folder == rpc == str(chosen) and pub == f"ipc://{chosen}/pdserve-kvev-decode-0-1.pub"
    assert list(shared.iterdir()) == []
