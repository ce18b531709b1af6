"""The request's timeout as the client may lower it: header ``X-Request-Timeout``
(seconds), never above the router's ``--request-timeout-s``. The deadline it fixes
is ``pdserve.router.dispatch.base.Deadline``."""

from __future__ import annotations

import math

from pdserve.router.http.errors import InvalidRequestError

TIMEOUT_HEADER = "x-request-timeout"


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
