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
- ``keep`` (vLLM's ``/pause?mode=keep``: requests frozen, resumed after): they are ended
  on the workers now and go on once the gate reopens, from their prompt and the tokens
  sent, on the new weights. Their responses mix versions on purpose, and say where:
  each chunk names its version, the response lists the spans (``usage.weight_versions``).

The gate is the router's, not one process's: with ``--processes N`` its state lives in a
board every process maps (``weight_board.py``). Closing, draining (every process's
requests), aborting (every process ends its own) and the new version hold in all of
them. A paused gate (vLLM's ``/pause``) is the same closed gate with no version change.
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
from pdserve.router.dispatch.weight_board import POLL_S, Published, WeightBoard

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
    of it went out, whether an update ended it (and whether it is kept: it goes on
    under the new version once the gate reopens, ``/pause?mode=keep``)."""

    request_id: str
    version: str  # "" : the router does not know the cluster's version yet (any)
    sent: bool = False
    aborted: bool = False
    kept: bool = False
    # Every token of the request that went out, under any ticket, whichever way it went
    # (added where each output becomes a chunk: ``dispatcher.py``, ``decode_stream.py``):
    # where a kept request goes on from.
    tokens: list[int] = field(default_factory=list)


class UpdateAborted(Exception):
    """A weight update ended this request (raised inside the dispatcher)."""


ABORT_ACK_S = 2.0  # how long an abort waits for the other processes to mark theirs


@dataclass
class WeightGate:
    """``version``: what requests are admitted under ("": not known yet: a router that
    has run no update and been told none; workers accept any). ``board``: what the
    router's processes share (``weight_board.py``); one process alone has its own.
    ``on_published``: called with each version another process published, before a
    request is admitted under it (the updater files the workers under it)."""

    version: str = ""
    board: WeightBoard = field(default_factory=WeightBoard.local)
    on_published: Callable[[Published], None] | None = None
    _running: dict[Ticket, None] = field(default_factory=dict)
    _epoch: int = 0
    _abort_seen: int = 0

    def __post_init__(self) -> None:
        self._epoch = self.board.version_epoch
        self._abort_seen = self.board.abort_epoch
        if self._epoch:
            self.version = self.board.published().version

    @property
    def paused(self) -> bool:
        return self.board.closed

    @property
    def running(self) -> list[Ticket]:
        return list(self._running)

    @contextlib.asynccontextmanager
    async def admitted(self, request_id: str, deadline: Deadline) -> AsyncIterator[Ticket]:
        """Wait while the gate is closed, in any process (raises the deadline's error
        past it), then hold a ticket for the request's life."""
        while self.board.closed:
            remaining = deadline.remaining_s()
            if remaining <= 0:
                raise deadline.exceeded("weight update")
            await asyncio.sleep(min(remaining, POLL_S))
        self.follow()
        ticket = Ticket(request_id, self.version)
        self._running[ticket] = None
        self.board.set_running(len(self._running))
        try:
            yield ticket
        finally:
            del self._running[ticket]
            self.board.set_running(len(self._running))

    def close(self) -> None:
        """Close admission in every process (an update)."""
        self.board.set_closing(True)

    def reopen(self, state: Published | None = None) -> None:
        """Admit again, in every process; under ``state``'s version when given (it is
        published to the other processes first)."""
        if state is not None:
            self.publish(state)
        self.board.set_closing(False)

    def publish(self, state: Published) -> None:
        """Admit under ``state``'s version from now on, in every process."""
        self.board.publish(state)
        self._epoch = self.board.version_epoch
        self.version = state.version

    def pause(self) -> None:
        self.board.set_paused(True)

    def resume(self) -> None:
        self.board.set_paused(False)

    async def wait_idle(self, timeout_s: float) -> bool:
        """Until no admitted request runs in any process, or ``timeout_s``; whether it
        got there."""
        deadline = time.monotonic() + timeout_s
        while self.board.num_running():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            await asyncio.sleep(min(remaining, POLL_S))
        return True

    def abort(self, request_ids: Iterable[str] | None = None,
              keep: bool = False) -> list[Ticket]:
        """Mark this process's running requests (all, or those named: ``request_names``)
        ended by an update (``keep``: to go on after it); the tickets."""
        wanted = None if request_ids is None else set(request_ids)
        tickets = [t for t in self._running
                   if wanted is None or not wanted.isdisjoint(request_names(t.request_id))]
        for ticket in tickets:
            ticket.aborted = True
            ticket.kept = keep
        return tickets

    async def abort_everywhere(self, keep: bool) -> list[Ticket]:
        """``abort`` every running request of every process: this one's now, the
        others' at their next ``follow`` (waited for, up to ``ABORT_ACK_S``); this
        process's tickets."""
        epoch = self.board.request_abort(keep)
        self._abort_seen = epoch
        tickets = self.abort(None, keep)
        self.board.ack_abort(epoch)
        deadline = time.monotonic() + ABORT_ACK_S
        while not self.board.all_acked(epoch) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if not self.board.all_acked(epoch):
            logger.warning("a router process did not mark its requests aborted within "
                           "%.1f s", ABORT_ACK_S)
        return tickets

    def follow(self) -> list[Ticket]:
        """Catch up with what another process did: a version it published (adopted,
        ``on_published``), an abort it asked for (this process's tickets, marked)."""
        if self.board.version_epoch != self._epoch:
            self._epoch = self.board.version_epoch
            state = self.board.published()
            self.version = state.version
            if self.on_published is not None:
                self.on_published(state)
        epoch = self.board.abort_epoch
        if epoch == self._abort_seen:
            return []
        self._abort_seen = epoch
        tickets = self.abort(None, self.board.abort_keeps)
        self.board.ack_abort(epoch)
        return tickets


async def versioned(gate: WeightGate, request_id: str, deadline: Deadline,
                    run: Callable[[Ticket, tuple[int, ...]], AsyncGenerator[TokenChunk, None]],
                    on_rerun: Callable[[], None]) -> AsyncGenerator[TokenChunk, None]:
    """``run``'s chunks under a ticket of ``gate``. A weight update that ends the request
    before any chunk went out runs it again (``on_rerun``) once the gate reopens on the
    new version; after one went out, the request ends with finish reason ``abort``,
    unless the update kept it (``keep``): then it goes on once the gate reopens, from
    its prompt and the tokens sent (``run``'s second argument), under the new version,
    whose chunks name it (the response's spans of versions change there)."""
    sent: list[int] = []
    while True:
        async with gate.admitted(request_id, deadline) as ticket:
            ticket.tokens = sent
            try:
                async with contextlib.aclosing(run(ticket, tuple(sent))) as chunks:
                    async for chunk in chunks:
                        ticket.sent = True  # its tokens are in ``sent`` already
                        yield chunk
                return
            except (UpdateAborted, WorkerFailedError, NoWorkerAvailableError):
                if not ticket.aborted:
                    raise
                if ticket.sent and not ticket.kept:
                    yield TokenChunk((), "abort", ended_by_update=True)
                    return
        on_rerun()
        logger.info("%s ended by a weight update %s: goes on on the new weights",
                    request_id, f"after {len(sent)} tokens (kept)" if sent else
                    "before any output")
