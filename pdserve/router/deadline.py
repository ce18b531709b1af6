"""One deadline per request, end to end.

It is fixed once, when the request arrives: the router's ``--request-timeout-s``, or
less if the client asks (header ``X-Request-Timeout``, seconds). Every worker call
gets what is *left* of it as its gRPC deadline, so prefill, decode and a decode retry
together never outlast it; a worker whose call's deadline passes has the call
cancelled, which aborts the request there and frees its KV. Past it the client gets
504 (or, once streaming, an error event and ``[DONE]``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from .errors import InvalidRequestError
from .types import DeadlineExceededError

TIMEOUT_HEADER = "x-request-timeout"


@dataclass(frozen=True)
class Deadline:
    """An instant on ``time.perf_counter()``'s clock (as ``arrival_s`` is)."""

    at_s: float
    timeout_s: float  # what it was set to, for messages

    @classmethod
    def after(cls, timeout_s: float, start_s: float | None = None) -> Deadline:
        start = time.perf_counter() if start_s is None else start_s
        return cls(start + timeout_s, timeout_s)

    def remaining_s(self) -> float:
        return self.at_s - time.perf_counter()

    def exceeded(self, what: str) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"the request's deadline ({self.timeout_s:g} s) passed during {what}")


def request_timeout_s(header: str | None, max_s: float) -> float:
    """The request's timeout: ``max_s``, or the header's value when that is less.
    Raises ``InvalidRequestError`` (400) for a value that is not a positive number."""
    if header is None:
        return max_s
    try:
        value = float(header)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise InvalidRequestError(
            f"X-Request-Timeout must be a positive number of seconds, not {header!r}",
            param="X-Request-Timeout", code="invalid_request_timeout")
    return min(value, max_s)
