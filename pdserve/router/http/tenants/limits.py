"""One tenant's limits, enforced: requests at once, and tokens per second as a token bucket.

The bucket holds up to ``capacity`` tokens and refills at ``tokens_per_s``. A request
is admitted while the bucket is not in debt (its level >= 0), whatever it will cost:
its prompt tokens are charged once they are known (after tokenizing) and its completion
tokens when it ends, and either may take the level below 0. The tenant then waits out
the debt: ``Retry-After`` is the time until the level is back at 0 (whole seconds,
at least 1). So a tenant's tokens over any long window stay within its rate plus one
bucket, and a long prompt is never refused outright for being longer than the bucket.

Over ``max_concurrent``: Retry-After 1 (a slot frees when one of its requests ends,
which the router cannot foresee). The token limit is checked first, as the longer wait.

Pure but for the clock, which is injected (``time.monotonic`` by default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.router.http.tenants.table import TenantLimits

RejectReason = Literal["concurrency", "tokens"]
REJECT_REASONS: tuple[RejectReason, ...] = ("concurrency", "tokens")
CONCURRENCY_RETRY_AFTER_S = 1


class TokenBucket:
    __slots__ = ("capacity", "rate", "_at", "_level")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate = rate
        self.capacity = capacity
        self._level = capacity
        self._at = now

    def level(self, now: float) -> float:
        """The tokens in the bucket at ``now`` (negative: in debt)."""
        if now > self._at:
            self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
            self._at = now
        return self._level

    def charge(self, num_tokens: int, now: float) -> None:
        self._level = self.level(now) - num_tokens

    def retry_after_s(self, now: float) -> int:
        """0 when not in debt; else the whole seconds (>= 1) until it is not."""
        level = self.level(now)
        return 0 if level >= 0 else max(1, math.ceil(-level / self.rate))


@dataclass(frozen=True)
class Refusal:
    reason: RejectReason
    retry_after_s: int


class TenantLimiter:
    """A tenant's requests in flight and its token bucket. ``acquire`` a request (None:
    admitted) and ``release`` it exactly once when it ends; ``charge`` its tokens."""

    def __init__(self, limits: TenantLimits,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.num_running = 0
        self._clock = clock
        self._bucket = (None if limits.tokens_per_s is None
                        else TokenBucket(limits.tokens_per_s, limits.capacity, clock()))

    def acquire(self) -> Refusal | None:
        if self._bucket is not None:
            wait_s = self._bucket.retry_after_s(self._clock())
            if wait_s:
                return Refusal("tokens", wait_s)
        if self.limits.max_concurrent is not None and \
                self.num_running >= self.limits.max_concurrent:
            return Refusal("concurrency", CONCURRENCY_RETRY_AFTER_S)
        self.num_running += 1
        return None

    def release(self) -> None:
        self.num_running -= 1

    def charge(self, num_tokens: int) -> None:
        if self._bucket is not None and num_tokens:
            self._bucket.charge(num_tokens, self._clock())

    def level(self) -> float | None:
        """The bucket's tokens now (None: no token limit)."""
        return None if self._bucket is None else self._bucket.level(self._clock())
