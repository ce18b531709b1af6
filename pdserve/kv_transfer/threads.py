"""Threads of the transfer layer, kept off the engine's compute cores' pinning."""

from __future__ import annotations

import os


def unpin_current_thread() -> None:
    """Let the calling thread run on any core the process may use.

    vLLM pins the Worker's main thread to a compute core and threads inherit that
    pin, so a transfer thread would queue behind the engine's own work on one core.
    Only the calling thread changes (Linux applies ``sched_setaffinity(0)`` to the
    calling thread); the engine's threads keep their affinity.
    """
    try:
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
    except (OSError, AttributeError):
        pass
