"""The weights version requests run under, the router's side: the gate every request
passes, and what an update does to the requests in flight.

Every request is admitted under the version the gate holds (a ``Ticket``) and names it
in each of its worker calls (``PhaseRequest.weight_version``): a worker on another
version refuses the call, so no response mixes two versions, whatever a stale view of
the workers says. An update closes the gate: requests arriving meanwhile wait (within
their deadline) and run on the new version once it reopens. The requests in flight:

- ``drain``: they finish on the old weights (up to the drain timeout; past it they
  are ended as with ``abort``).
- ``abort``: they are ended now. One that has not sent a token yet runs again, from its
  prompt, on the new weights once the gate reopens: its client sees nothing but a later
  first token. One whose tokens went out already ends with finish reason ``abort``
  (vLLM's own ``/pause?mode=abort``): continuing it on new weights would mix versions.

A paused gate (vLLM's ``/pause``) is the same closed gate with no version change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from pdserve.router.dispatch.base import (
    Deadline,
    NoWorkerAvailableError,
    TokenChunk,
    WorkerFailedError,
)

logger = logging.getLogger("pdserve.router.dispatch")

POLICIES = ("drain", "abort")
# The workers' id of a request: ``<response id>.<32 hex>``, and ``-<i>`` after it for
# choice i of ``n`` > 1 (``openai/preprocess.py``, ``openai/serving.py``).
_WORKER_ID = re.compile(r"^(?P<response>.+)\.[0-9a-f]{32}(?:-\d+)?$")


def request_names(request_id: str) -> set[str]:
    """The names an abort may give a request: the workers' id, that id's request without
    its choice suffix, the response id its client saw (``chatcmpl-X``), and the client's
    own ``X-Request-Id`` (``X``)."""
    names = {request_id, request_id.rsplit("-", 1)[0]}
    match = _WORKER_ID.match(request_id)
    if match is not None:
        response = match["response"]
        names.add(response)
        prefix, _, client = response.partition("-")
        if prefix in ("cmpl", "chatcmpl") and client:
            names.add(client)
    return names


@dataclass(eq=False)
class Ticket:
    """One dispatcher request's admission: the version it runs under, whether a token
    of it went out, whether an update ended it."""

    request_id: str
    version: str  # "" : the router does not know the cluster's version yet (any)
    sent: bool = False
    aborted: bool = False


class UpdateAborted(Exception):
    """A weight update ended this request (raised inside the dispatcher)."""


@dataclass
class WeightGate:
    """``version``: what requests are admitted under ("": not known yet: a router that
    has run no update and been told none; workers accept any)."""

    version: str = ""
    _open: asyncio.Event = field(default_factory=asyncio.Event)
    _running: dict[Ticket, None] = field(default_factory=dict)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._open.set()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    @property
    def running(self) -> list[Ticket]:
        return list(self._running)

    @contextlib.asynccontextmanager
    async def admitted(self, request_id: str, deadline: Deadline) -> AsyncIterator[Ticket]:
        """Wait while the gate is closed (raises the deadline's error past it), then hold
        a ticket for the request's life."""
        while not self._open.is_set():
            remaining = deadline.remaining_s()
            if remaining <= 0:
                raise deadline.exceeded("weight update")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._open.wait(), remaining)
        ticket = Ticket(request_id, self.version)
        self._running[ticket] = None
        self._idle.clear()
        try:
            yield ticket
        finally:
            del self._running[ticket]
            if not self._running:
                self._idle.set()

    def close(self) -> None:
        self._open.clear()

    def reopen(self, version: str | None = None) -> None:
        """Admit again, under ``version`` (None: the same)."""
        if version is not None:
            self.version = version
        self._open.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no admitted request runs, or ``timeout_s``; whether it got there."""
        deadline = time.monotonic() + timeout_s
        while self._running:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), remaining)
        return True

    def abort(self, request_ids: Iterable[str] | None = None) -> list[Ticket]:
        """Mark the running requests (all, or those named: ``request_names``) ended by an
        update; the tickets."""
        wanted = None if request_ids is None else set(request_ids)
        tickets = [t for t in self._running
                   if wanted is None or not wanted.isdisjoint(request_names(t.request_id))]
        for ticket in tickets:
            ticket.aborted = True
        return tickets


async def versioned(gate: WeightGate, request_id: str, deadline: Deadline,
                    run: Callable[[Ticket], AsyncGenerator[TokenChunk, None]],
                    on_rerun: Callable[[], None]) -> AsyncGenerator[TokenChunk, None]:
    """``run``'s chunks under a ticket of ``gate``. A weight update that ends the request
    before any chunk went out runs it again (``on_rerun``) once the gate reopens on the
    new version; after one went out, the request ends with finish reason ``abort``."""
    while True:
        async with gate.admitted(request_id, deadline) as ticket:
            try:
                async with contextlib.aclosing(run(ticket)) as chunks:
                    async for chunk in chunks:
                        ticket.sent = True
                        yield chunk
                return
            except (UpdateAborted, WorkerFailedError, NoWorkerAvailableError):
                if not ticket.aborted:
                    raise
                if ticket.sent:
                    yield TokenChunk((), "abort", ended_by_update=True)
                    return
        on_rerun()
        logger.info("%s ended by a weight update before any output: runs again on the new "
                    "weights", request_id)
