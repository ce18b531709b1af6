"""Deadlines that hold even when the awaited call ignores its cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


async def bounded(aw: Awaitable[T], timeout_s: float) -> T:
    """Await ``aw`` for at most ``timeout_s``, then raise ``TimeoutError``.

    Unlike ``asyncio.wait_for``, which on expiry waits for the cancelled call to
    finish, this returns at the deadline even if the call never acknowledges its
    cancellation: a call stuck on a hung peer, or a gRPC server whose
    shutdown never completes, cannot hold its caller past the deadline.
    """
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(_consume_result)
        raise TimeoutError(f"no answer within {timeout_s:.1f}s")
    return task.result()


def _consume_result(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
