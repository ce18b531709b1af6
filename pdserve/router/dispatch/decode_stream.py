"""A request's decode outputs becoming its chunks, whichever way each chunk goes out.

Each output of a decode call becomes one ``TokenChunk`` and gets its bookkeeping once,
here: the request's timeline, its migration record (the tokens a continuation starts
after), its weights ticket (the tokens a kept request goes on from). A chunk goes out
one of two ways:
- ``chunk``: the request's task yields it (``phases.Phases.decode``), as every chunk
  that opens a call, ends it, or carries more than tokens does.
- ``tap``: the worker session's reader offers an ordinary output (tokens alone) that
  arrives while that task waits idle for it (``workers/session.SessionStream.offer``);
  the request's ``ChunkSink`` writes it to the client from there, or declines it and
  the output is queued for the task as usual.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.core.types import PhaseOutput, PhaseTiming
from pdserve.router.dispatch.base import ChunkSink, TokenChunk
from pdserve.router.dispatch.migration import RequestMigration
from pdserve.router.dispatch.policies.disagg import DisaggDecision
from pdserve.router.dispatch.timeline import RequestTimeline
from pdserve.router.dispatch.weights import Ticket


class DecodeStream:
    """The chunks of one request's decode calls (a migration starts another call)."""

    __slots__ = ("_timeline", "_migration", "_tokens", "_sink", "opening", "worker_id",
                 "prefilling")

    def __init__(self, timeline: RequestTimeline, migration: RequestMigration, ticket: Ticket,
                 opening: DisaggDecision | None, sink: ChunkSink | None) -> None:
        """``opening``: set when decode's first chunk opens the request (no prefill chunk
        came before it); that chunk carries it and decode's cached tokens."""
        self._timeline = timeline
        self._migration = migration
        self._tokens = ticket.tokens
        self._sink = sink
        self.opening = opening
        self.worker_id: str | None = None  # the worker of the current call
        # The call computes the prompt first: its first output ends that, and is the task's.
        self.prefilling = False

    def call(self, worker_id: str, prefilling: bool) -> None:
        """A decode call starts on ``worker_id``; ``prefilling``: it computes (part of) the
        prompt before its first token (no KV handle)."""
        self.worker_id = worker_id
        self.prefilling = prefilling

    def on_migrated(self) -> None:
        """The request goes on on another worker (the next ``call``)."""
        self._timeline.on_migrated()

    def chunk(self, out: PhaseOutput) -> TokenChunk:
        """``out`` as the chunk the request's task yields next."""
        self._sent(out.token_ids, out.timing)
        opening, self.opening, self.prefilling = self.opening, None, False
        if opening is None and out.finish_reason is None and not (
                out.logprobs or out.prompt_logprobs or out.weight_version):
            return _plain(out.token_ids, self.worker_id)
        return TokenChunk(out.token_ids, out.finish_reason,
                          out.num_cached_tokens if opening is not None else None, opening,
                          out.logprobs, out.prompt_logprobs, self.worker_id,
                          out.weight_version or None)

    def tap(self, token_ids: tuple[int, ...]) -> bool:
        """Offer an ordinary output (``token_ids`` alone) to the request's sink: True, the
        sink wrote it (its bookkeeping done here); False, the task gets it as usual."""
        sink = self._sink
        if sink is None or not sink.accepting or self.prefilling or self.opening is not None:
            return False
        if not sink.offer(_plain(token_ids, self.worker_id)):
            return False
        self._sent(token_ids, None)
        return True

    def _sent(self, token_ids: Sequence[int], timing: PhaseTiming | None) -> None:
        self._timeline.on_decode(len(token_ids), timing)
        self._migration.on_sent(token_ids)
        self._tokens.extend(token_ids)


def _plain(token_ids: tuple[int, ...], worker_id: str | None) -> TokenChunk:
    """A chunk of tokens alone (``TokenChunk.plain``); positional: one is made per token."""
    return TokenChunk(token_ids, None, None, None, (), (), worker_id, None, None, False, True)
