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
A request takes one slot per sequence it samples (``n``): ``acquire(num)``.

The state lives in a ``TenantLedger`` (``ledger.py``): this process's memory, or the
memory that every process of ``--processes N`` maps, so the limits hold exactly across
them (``time.monotonic`` is one clock for every process of a host). Pure but for the
ledger and the clock, which is injected (``time.monotonic`` by default).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pdserve.router.http.tenants.ledger import TenantLedger
from pdserve.router.http.tenants.table import TenantLimits

RejectReason = Literal["concurrency", "tokens"]
REJECT_REASONS: tuple[RejectReason, ...] = ("concurrency", "tokens")
CONCURRENCY_RETRY_AFTER_S = 1


class TokenBucket:
    __slots__ = ("capacity", "rate", "_at", "_level")

    def __init__(self, rate: float, capacity: float, now: float,
                 level: float | None = None) -> None:
        self.rate = rate
        self.capacity = capacity
        self._level = capacity if level is None else level
        self._at = now

    @property
    def state(self) -> tuple[float, float]:
        """(level, at): what ``TokenBucket(rate, capacity, at, level)`` restores."""
        return self._level, self._at

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
    """A tenant's sequences in flight and its token bucket, kept in ``ledger`` at
    ``index`` (default: a ledger of its own). ``acquire`` slots for a request (None:
    admitted) and ``release`` them exactly once when it ends; ``charge`` its tokens."""

    def __init__(self, limits: TenantLimits,
                 clock: Callable[[], float] = time.monotonic,
                 ledger: TenantLedger | None = None, index: int = 0) -> None:
        self.limits = limits
        self._clock = clock
        self._ledger = ledger if ledger is not None else TenantLedger.local(1)
        self._index = index

    @property
    def num_running(self) -> int:
        """The tenant's sequences in flight, in every process of the ledger."""
        return self._ledger.num_running(self._index)

    def acquire(self, num: int = 1) -> Refusal | None:
        refusal = self._try_acquire(num)
        if refusal is not None and refusal.reason == "concurrency" and \
                self._ledger.reclaim(self._index):  # a dead process held some: try again
            refusal = self._try_acquire(num)
        return refusal

    def release(self, num: int = 1) -> None:
        with self._ledger.locked():
            self._ledger.add(self._index, -num)

    def charge(self, num_tokens: int) -> None:
        if self.limits.tokens_per_s is None or not num_tokens:
            return
        now = self._clock()
        with self._ledger.locked():
            bucket = self._bucket(now)
            bucket.charge(num_tokens, now)
            self._ledger.set_bucket(self._index, *bucket.state)

    def level(self) -> float | None:
        """The bucket's tokens now (None: no token limit)."""
        if self.limits.tokens_per_s is None:
            return None
        now = self._clock()
        with self._ledger.locked():
            return self._bucket(now).level(now)

    def _try_acquire(self, num: int) -> Refusal | None:
        now = self._clock()
        maximum = self.limits.max_concurrent
        with self._ledger.locked():
            if self.limits.tokens_per_s is not None:
                bucket = self._bucket(now)
                wait_s = bucket.retry_after_s(now)
                self._ledger.set_bucket(self._index, *bucket.state)
                if wait_s:
                    return Refusal("tokens", wait_s)
            if maximum is not None and self._ledger.num_running(self._index) + num > maximum:
                return Refusal("concurrency", CONCURRENCY_RETRY_AFTER_S)
            self._ledger.add(self._index, num)
        return None

    def _bucket(self, now: float) -> TokenBucket:
        """The tenant's bucket as the ledger holds it (under the lock)."""
        rate = self.limits.tokens_per_s or 0.0
        level, at = self._ledger.bucket(self._index)
        if math.isnan(at):  # never used: full
            return TokenBucket(rate, self.limits.capacity, now)
        return TokenBucket(rate, self.limits.capacity, at, level)
