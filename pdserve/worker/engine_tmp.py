"""The engine's own temporary folder.

vLLM names its ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``) and its torch.distributed
rendezvous file (``file://$TMPDIR/vllm_dist_<hex>``) at random in the system's temporary
folder and leaves them there when its processes are killed: a node whose workers restart
gathers thousands of dead sockets in ``/tmp``. A worker gives its engine a folder of its
own instead, ``pdserve-vllm-<pid>-<random>`` in the temporary folder (the engine's child
processes inherit it through ``VLLM_RPC_BASE_PATH`` and ``TMPDIR``), removes it when it
exits, and at start removes the folders of workers that were killed (their pid is gone).
The engine's KV event sockets (``vllm/kv_events.py``) go there too: the folder is 0700,
so no other user can bind or plant a socket at a name the worker will use.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger("pdserve.worker")

PREFIX = "pdserve-vllm-"
_OWNED = re.compile(rf"^{re.escape(PREFIX)}(?P<pid>\d+)-[A-Za-z0-9_]+$")


@functools.cache
def engine_folder() -> Path:
    """This worker's engine folder, the same on every call: the operator's
    ``VLLM_RPC_BASE_PATH`` when it was set before the first call, else one of its own
    (``engine_tmp_dir``), made on the first call."""
    chosen = os.environ.get("VLLM_RPC_BASE_PATH")
    return Path(chosen) if chosen else engine_tmp_dir()


def engine_tmp_dir(base: Path | None = None) -> Path:
    """Make this process's engine folder under ``base`` (the temporary folder), point
    vLLM at it, remove it at exit; first remove dead workers' folders."""
    base = base or Path(tempfile.gettempdir())
    sweep_dead(base)
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=base))
    os.environ.update(vllm_tmp_env(folder))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def vllm_tmp_env(folder: Path) -> dict[str, str]:
    """The variables that put vLLM's ZMQ sockets (``VLLM_RPC_BASE_PATH``) and its
    engine processes' rendezvous file (``TMPDIR``: ``file://$TMPDIR/vllm_dist_*``) in
    ``folder``, for this process or a child's environment."""
    return {"VLLM_RPC_BASE_PATH": str(folder), "TMPDIR": str(folder)}


def sweep_dead(base: Path) -> list[Path]:
    """Remove the engine folders under ``base`` whose worker process is gone; those."""
    removed: list[Path] = []
    try:
        entries = list(base.iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _OWNED.match(entry.name)
        if match is None or _alive(int(match["pid"])) or not entry.is_dir():
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry)
    if removed:
        logger.info("removed %d engine folders of workers that are gone", len(removed))
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
