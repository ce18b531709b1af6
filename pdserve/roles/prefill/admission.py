"""Prefill in order: how many prompts a prefill worker's engine computes at once, and
which waiting prompt goes in next.

A prefill engine given every prompt at once interleaves them: with chunked prefill each
advances a chunk per step, so all of them finish late (each waits for the others' chunks)
instead of most finishing early. In front of the engine, the worker admits at most
``max_running`` prompts; the others wait here, in ``order``:

- ``fifo``: arrival order; every prompt's wait is bounded by the work ahead of it.
- ``shortest``: fewest prompt tokens first (ties by arrival): the mean wait is lowest, a
  long prompt waits while shorter ones keep arriving (bounded by ``max_wait_s``: a
  prompt that has waited that long goes next, whatever its length).

``max_running`` 0 admits everything at once (vLLM's own scheduling alone). It lives in the
prefill role, outside the engine: a worker switched to prefill at run time gets it, one
switched to decode drops it, and no engine restarts. Every wait ends when its request is
cancelled (the router closed the call, or its deadline passed) or aborted (``abort``: the
request never enters the engine; a role switch's drain aborts the waiting ones so).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from pdserve.worker.policy import AdmissionAborted

ORDERS = ("fifo", "shortest")
DEFAULT_MAX_WAIT_S = 10.0


@dataclass(frozen=True)
class AdmissionConfig:
    max_running: int = 0  # prompts in the engine at once; 0: no limit
    order: str = "shortest"
    max_wait_s: float = DEFAULT_MAX_WAIT_S  # ``shortest``: a prompt waits no longer first

    def __post_init__(self) -> None:
        if self.max_running < 0:
            raise ValueError("prefill max_running must be >= 0 (0: no limit)")
        if self.order not in ORDERS:
            raise ValueError(f"prefill order must be one of {', '.join(ORDERS)}, "
                             f"not {self.order!r}")
        if not self.max_wait_s > 0:
            raise ValueError("prefill max_wait_s must be > 0")


class PrefillAdmission:
    """The gate in front of a prefill engine. ``admitted(num_tokens)`` is held for as
    long as the prompt is in the engine. Runs on the worker's event loop."""

    def __init__(self, config: AdmissionConfig,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._now = clock
        self._running = 0
        self._seq = itertools.count()
        # (key, seq, arrival, future): the heap orders by key, then arrival.
        self._waiting: list[tuple[int, int, float, asyncio.Future[None]]] = []
        self._by_id: dict[str, asyncio.Future[None]] = {}  # waiting, by request id

    @property
    def num_running(self) -> int:
        return self._running

    @property
    def num_waiting(self) -> int:
        return sum(1 for *_, f in self._waiting if not f.done())

    def abort(self, request_id: str) -> bool:
        """End ``request_id``'s wait: its ``admitted`` raises ``AdmissionAborted``."""
        future = self._by_id.get(request_id)
        if future is None or future.done():
            return False
        future.set_exception(AdmissionAborted(f"{request_id} aborted while it waited"))
        return True

    @contextlib.asynccontextmanager
    async def admitted(self, num_tokens: int, request_id: str = "") -> AsyncIterator[float]:
        """Wait for a place in the engine; yields the seconds waited."""
        start = self._now()
        limit = self.config.max_running
        if limit == 0 or (self._running < limit and not self.num_waiting):
            self._running += 1
        else:
            await self._wait(num_tokens, start, request_id)
        try:
            yield self._now() - start
        finally:
            self._running -= 1
            self._admit_next()

    async def _wait(self, num_tokens: int, arrival: float, request_id: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        key = num_tokens if self.config.order == "shortest" else 0
        heapq.heappush(self._waiting, (key, next(self._seq), arrival, future))
        if request_id:
            self._by_id[request_id] = future
        try:
            await future  # set once ``_admit_next`` counted this prompt as running
        except BaseException:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._running -= 1  # admitted, then cancelled before it ran: pass it on
                self._admit_next()
            elif not future.done():
                future.cancel()  # the heap drops it when it comes to the top
            raise
        finally:
            if self._by_id.get(request_id) is future:
                del self._by_id[request_id]

    def _admit_next(self) -> None:
        limit = self.config.max_running
        while self._waiting and (limit == 0 or self._running < limit):
            entry = self._next()
            if entry[3].done():
                continue  # cancelled while it waited
            self._running += 1
            entry[3].set_result(None)

    def _next(self) -> tuple[int, int, float, asyncio.Future[None]]:
        """The next to go: the heap's top, or (``shortest``) the earliest arrival that
        has waited ``max_wait_s``."""
        if self.config.order == "shortest":
            now, oldest = self._now(), None
            for i, entry in enumerate(self._waiting):
                if (not entry[3].done() and now - entry[2] >= self.config.max_wait_s
                        and (oldest is None or entry[1] < self._waiting[oldest][1])):
                    oldest = i
            if oldest is not None:
                entry = self._waiting.pop(oldest)
                heapq.heapify(self._waiting)
                return entry
        return heapq.heappop(self._waiting)
