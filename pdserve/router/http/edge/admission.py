"""Admission control: at most ``max_running`` generation requests run, at most
``max_queued`` wait (each at most ``max_wait_s``) for a slot; the rest get a 429 at once.

Memory stays bounded whatever the offered load: a request is admitted or queued before
its body is read, so a refused one costs a 429 and nothing else, and a queued one holds a
socket and one future. Slots are handed over FIFO, straight from the request that ends
to the oldest waiter, so a newcomer never overtakes the queue.

Drain (SIGTERM): from ``start_drain()`` on, new requests and those still queued get a
503; ``wait_drained()`` returns when the running ones have finished.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.http.errors import (
    APIError,
    ServiceUnavailableError,
    TooManyRequestsError,
    send_error,
)

# Retry-After on a full queue: the queue turns over in about a request's duration, which
# the router does not know; one second lets clients with backoff retry soon.
RETRY_AFTER_S = 1


def draining_error() -> ServiceUnavailableError:
    return ServiceUnavailableError("the router is shutting down", code="draining")


class Admission:
    def __init__(self, max_running: int, max_queued: int, max_wait_s: float) -> None:
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_wait_s = max_wait_s
        self.num_running = 0
        self.draining = False
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def num_waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> None:
        """Take a slot, waiting in the queue if need be; raise the ``APIError`` to answer
        (429 queue full or waited too long, 503 draining) when none is given."""
        if self.draining:
            raise draining_error()
        if self.num_running < self.max_running and not self._waiters:
            self._take()
            return
        if len(self._waiters) >= self.max_queued:
            raise TooManyRequestsError(
                f"The server is at its limit of {self.max_running} running and "
                f"{self.max_queued} queued requests; retry later.", RETRY_AFTER_S)
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            # On timeout or cancellation wait_for cancels the waiter, unless it was handed
            # a slot meanwhile: then it returns normally and the slot is ours.
            await asyncio.wait_for(waiter, self.max_wait_s)
        except TimeoutError:
            raise TooManyRequestsError(
                f"No request slot became free within {self.max_wait_s:g} s; retry later.",
                RETRY_AFTER_S) from None
        finally:
            if waiter in self._waiters:  # gave up: keep the queue to live waiters
                self._waiters.remove(waiter)
            self._update_idle()

    def release(self) -> None:
        """End a running request: its slot goes to the oldest waiter, if any."""
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot changes hands: num_running unchanged
                return
        self.num_running -= 1
        self._update_idle()

    def start_drain(self) -> None:
        """Admit nothing more; queued requests get their 503 now."""
        self.draining = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(draining_error())
        self._update_idle()

    async def wait_drained(self, timeout_s: float) -> bool:
        """True once nothing runs or waits; False if that took longer than ``timeout_s``."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def _take(self) -> None:
        self.num_running += 1
        self._idle.clear()

    def _update_idle(self) -> None:
        if self.num_running == 0 and not self._waiters:
            self._idle.set()
        else:
            self._idle.clear()


class AdmissionMiddleware:
    """Holds a slot for the whole response of a generation request, stream included."""

    def __init__(self, app: ASGIApp, admission: Admission, paths: frozenset[str]) -> None:
        self.app = app
        self._admission = admission
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self._paths:
            await self.app(scope, receive, send)
            return
        try:
            await self._admission.acquire()
        except APIError as exc:
            await send_error(scope, send, exc)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            self._admission.release()
