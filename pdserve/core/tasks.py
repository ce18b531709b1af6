"""Background tasks stopped the one way: cancelled, then awaited, so that their cleanup
has run (and nothing is left pending) when ``close`` returns."""

from __future__ import annotations

import asyncio
from typing import Any


async def cancel_and_wait(task: asyncio.Task[Any] | None) -> None:
    """Cancel ``task`` (None: nothing to do) and wait until it has ended; what it raised
    (its cancellation included) is not re-raised: the caller is stopping it."""
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
