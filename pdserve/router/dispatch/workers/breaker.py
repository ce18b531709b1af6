"""A circuit breaker per worker: a worker whose calls keep failing is ejected from
placement for a back-off, then readmitted on trial.

Closed: calls go through; each failure that is the worker's counts, a success resets
the count. ``threshold`` failures in a row open it: no placement for ``backoff_s``
(starting at ``base_backoff_s``, doubling on each reopening, at most ``max_backoff_s``).
When the back-off has passed the worker is placeable again (half-open): its next
failure reopens the breaker at once, its next success closes it and resets the back-off.

Which failures are the worker's: everything but what the caller caused (an invalid
request, a cancellation) and a deadline. A deadline is the client's choice
(``X-Request-Timeout``), so counting it would let clients eject healthy workers; a
hung worker is caught by keepalive (UNAVAILABLE) instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.router.dispatch.workers.client import (
    ABORTED,
    CANCELLED,
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
)

# ABORTED: the worker serves the request's LoRA adapter from another folder (a refit
# half done, ``worker/lora/adapters.py``): the request runs elsewhere, the worker is sound.
NOT_THE_WORKERS = frozenset({INVALID_ARGUMENT, CANCELLED, DEADLINE_EXCEEDED, ABORTED})


@dataclass(frozen=True)
class BreakerConfig:
    threshold: int = 5  # failures in a row that eject a worker
    base_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Where the back-off's time comes from (tests pass a fake clock).
    clock: Callable[[], float] = field(default=time.monotonic, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.threshold < 1 or not 0 < self.base_backoff_s <= self.max_backoff_s:
            raise ValueError("need threshold >= 1 and 0 < base_backoff_s <= max_backoff_s")


DEFAULT_BREAKER = BreakerConfig()


class CircuitBreaker:
    def __init__(self, config: BreakerConfig | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        self.config = config = config or DEFAULT_BREAKER
        self.num_failures = 0  # in a row
        self.backoff_s = config.base_backoff_s  # the next opening's
        self.open_for_s = 0.0  # the last opening's
        self._open_until = 0.0
        self._clock = clock or config.clock

    def is_open(self) -> bool:
        """Whether the worker is ejected now."""
        return self._open_until > self._clock()

    def on_failure(self, code: str) -> bool:
        """A call failed with gRPC status ``code``; True if this opened the breaker."""
        if code in NOT_THE_WORKERS:
            return False
        self.num_failures += 1
        if self.num_failures < self.config.threshold or self.is_open():
            return False  # an open breaker: calls sent before it opened end now
        self.open_for_s = self.backoff_s
        self._open_until = self._clock() + self.open_for_s
        self.backoff_s = min(self.backoff_s * 2, self.config.max_backoff_s)
        return True

    def on_success(self) -> None:
        self.num_failures = 0
        self.backoff_s = self.config.base_backoff_s
        self._open_until = 0.0
