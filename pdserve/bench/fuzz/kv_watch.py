"""What a fuzzed KV server in this process shows of a crash or a leak: server threads
that died with an exception, handler failures the control server logged, and its
connection threads (each fuzzed connection must give its thread back)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

SERVER_THREAD = "pdserve-kv-conn"  # control/server.py's name for a connection's thread
# Where the control server logs a handler's unexpected failure (its safety net).
CONTROL_LOGGER = "pdserve.kv_transfer.control"


@dataclass(frozen=True)
class Leaks:
    """What a fuzz left held once every connection ended: leases (stuck in transfer,
    or pool serves never finished), staged inbox blocks no accepted push owns, and the
    serving threads (baseline, after); None where a target cannot see it."""

    leases: int | None
    blocks: int | None
    threads: tuple[int, int] | None

    @property
    def total(self) -> int:
        held = (self.leases or 0) + (self.blocks or 0)
        if self.threads is not None:
            held += max(0, self.threads[1] - self.threads[0])
        return held


class CrashWatch:
    """Records, from creation to ``close``, every KV server thread that died of an
    exception and every handler failure logged at ERROR by the control server."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: Counter[str] = Counter()
        self._previous_hook = threading.excepthook
        threading.excepthook = self._hook
        self._handler = _Recorder(self._note)
        logging.getLogger(CONTROL_LOGGER).addHandler(self._handler)

    def events(self) -> list[str]:
        """Each distinct crash, with how often it happened."""
        with self._lock:
            return [f"{what} (x{n})" for what, n in self._events.most_common()]

    def close(self) -> None:
        threading.excepthook = self._previous_hook
        logging.getLogger(CONTROL_LOGGER).removeHandler(self._handler)

    def _hook(self, args: threading.ExceptHookArgs) -> None:
        name = args.thread.name if args.thread is not None else "?"
        if name.startswith("pdserve-kv"):
            self._note(f"thread {name} died: {args.exc_type.__name__}: {args.exc_value}")
        else:
            self._previous_hook(args)

    def _note(self, what: str) -> None:
        with self._lock:
            self._events[what[:300]] += 1


class _Recorder(logging.Handler):
    def __init__(self, note: Callable[[str], None]) -> None:
        super().__init__(logging.ERROR)
        self._note = note

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        detail = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        self._note(f"handler failed: {record.msg}{detail}")  # the template: no peer address


def server_threads(prefix: str = SERVER_THREAD) -> int:
    """KV connection threads alive in this process (``prefix``: threads named so)."""
    return sum(1 for t in threading.enumerate() if t.name.startswith(prefix))


def wait_threads(baseline: int, timeout_s: float, prefix: str = SERVER_THREAD) -> int:
    """The connection threads once they are back to ``baseline`` or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while (now := server_threads(prefix)) > baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    return now
