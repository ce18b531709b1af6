"""Calling every worker of a cluster at once, and what an admin call answers when some
of them fail (``weight_updates.py``'s fan-outs)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

from pdserve.router.cluster.errors import ClusterError, Conflict, Failed, Invalid
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.dispatch.workers.pool import Worker

T = TypeVar("T")


async def each_worker(workers: Sequence[Worker], call: Callable[[Worker], Awaitable[T]]
                      ) -> dict[str, T | Exception]:
    """``call`` on every worker at once: each one's result or error, by worker id."""
    results = await asyncio.gather(*(call(w) for w in workers), return_exceptions=True)
    out: dict[str, T | Exception] = {}
    for worker, result in zip(workers, results, strict=True):
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        out[worker.snapshot().worker_id] = result
    return out


async def quietly(call: Awaitable[Any]) -> None:
    try:
        await call
    except WorkerCallError:
        pass


def call_error(method: str, results: dict[str, Any]) -> ClusterError:
    """What a failed engine call answers: the caller's mistake (a body a worker refused,
    a call it was not started for) when every worker said so, else a server error."""
    message = f"{method} failed: {first_error(results)}"
    codes = {r.code if isinstance(r, WorkerCallError) else "" for r in results.values()
             if isinstance(r, Exception)}
    if codes == {"INVALID_ARGUMENT"}:
        return Invalid(message, code="weight_call_invalid")
    if codes <= {"INVALID_ARGUMENT", "FAILED_PRECONDITION"}:
        return Conflict(message, code="weight_transfer_off"
                        if codes == {"FAILED_PRECONDITION"} else "weight_call_refused")
    return Failed(message, code="weight_call_failed")


def first_error(results: dict[str, Any]) -> str:
    for name, r in results.items():
        if isinstance(r, Exception):
            return f"worker {name}: {r.details if isinstance(r, WorkerCallError) else r}"
    return ""
