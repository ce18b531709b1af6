"""How a request ended, as the metrics see it: the status and a reason, recorded in the
ASGI scope by whoever decides it, read by ``RequestMetricsMiddleware`` when the response
is done.

The response's status line is not enough: a stream answers 200 before its first token
and may still fail midway (the failure goes in-band as an SSE error event), or end when
the client goes away. ``serving.py`` records those; the error handlers and the edge's
rejections record theirs, so a failure is counted by its reason wherever it happened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from starlette.types import Scope

if TYPE_CHECKING:
    from pdserve.router.http.base import APIError

_KEY = "pdserve.outcome"
CLIENT_CLOSED = "client_closed"


@dataclass(frozen=True)
class Outcome:
    status: int
    reason: str  # "ok", an OpenAI error code ("worker_failed", "too_many_requests"...), ...


def record_outcome(scope: Scope, status: int, reason: str) -> None:
    """The last record wins: a later, more specific one (the stream's) replaces it."""
    scope[_KEY] = Outcome(status, reason)


def outcome_of(scope: Scope) -> Outcome | None:
    outcome = scope.get(_KEY)
    return outcome if isinstance(outcome, Outcome) else None


def outcome_reason(error: APIError) -> str:
    return error.code or error.error_type
