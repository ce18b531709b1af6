"""A file written whole or not at all (``write_atomic``): readers that poll it (Prometheus,
a restarting worker, a bench's report reader) never see half of it, and the write goes
through a fresh temporary file, never a fixed name that another user could have linked
somewhere else in a shared folder such as ``/tmp``."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    """Write ``text`` to ``path``: into a new temporary file beside it (``mkstemp``),
    given ``mode`` whatever the umask, then renamed over ``path``. The temporary file is
    removed if anything fails; ``OSError`` goes on to the caller."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            os.fchmod(f.fileno(), mode)
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
