"""``RoleSampler``: what roles a pdserve system's workers serve during a bench run, read
from its router's ``GET /workers`` once a second on a thread of its own (a planner or
an admin may switch them while the load runs). Times are seconds since ``start``."""

from __future__ import annotations

import threading
import time
from types import TracebackType

import httpx

INTERVAL_S = 1.0


class RoleSampler:
    """``samples``: [seconds, placeable prefill workers, placeable decode workers]."""

    def __init__(self, base_url: str, interval_s: float = INTERVAL_S) -> None:
        self._url = base_url.rstrip("/") + "/workers"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-role-sampler",
                                        daemon=True)
        self._started = 0.0
        self.samples: list[list[float]] = []

    def __enter__(self) -> RoleSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s + 3.0)

    def _run(self) -> None:
        with httpx.Client(timeout=2.0) as client:
            while not self._stop.is_set():
                try:
                    workers = client.get(self._url).json()["workers"]
                except (httpx.HTTPError, ValueError, KeyError, TypeError):
                    workers = None
                if workers is not None:
                    healthy = [w for w in workers if w.get("healthy")]
                    self.samples.append([round(time.monotonic() - self._started, 2),
                                         sum(w.get("role") == "prefill" for w in healthy),
                                         sum(w.get("role") == "decode" for w in healthy)])
                self._stop.wait(self._interval_s)
