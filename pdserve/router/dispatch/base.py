"""Domain types shared by the router's HTTP layer and its dispatcher.

The HTTP layer (``app.py``) validates OpenAI requests, tokenizes once and turns
token chunks into OpenAI responses. The dispatcher (``dispatcher.py``) owns the
workers: it picks a prefill and a decode worker, runs the two phases and yields
token chunks. Neither knows the other's internals; this module is the contract.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pdserve.core.types import FinishReason, SamplingSpec, TokenLogprobs
from pdserve.router.dispatch.policies.disagg import DisaggDecision

if TYPE_CHECKING:
    from pdserve.router.dispatch.timeline import RequestTimeline


@dataclass(slots=True)
class TokenChunk:
    """Tokens produced since the previous chunk; a value, never changed once made (not
    ``frozen``: one is made per streamed token, and a frozen dataclass's ``__init__``,
    a ``object.__setattr__`` per field, cost 4x a plain one's: ~3 µs of the router's
    CPU per token).

    ``finish_reason`` is set on the last chunk only. ``num_cached_tokens`` (prompt
    tokens served from a prefix cache) is set on the first chunk, when known, and so
    is ``disagg``: where the prompt was computed, decided before any worker call, so
    the HTTP layer can send it as a header with the first byte.
    """

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_cached_tokens: int | None = None
    disagg: DisaggDecision | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # per token of token_ids, when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # on the first chunk, when asked
    decode_worker_id: str | None = None  # on decode's chunks: the worker generating
    # On the first chunk: the weights version producing every token of the request.
    weight_version: str | None = None
    # On the first chunk of a request under a LoRA adapter: the folder's tag
    # (``LoraAdapter.tag``) producing its tokens, until a chunk names another (a request
    # ``keep`` carried through an adapter refit goes on under the new folder).
    adapter: str | None = None
    # With finish reason ``abort``: a weight update (policy abort) ended the request on
    # purpose, after some of its tokens went out; the client sees finish reason
    # ``abort``, as from vLLM's ``/pause``. Any other ``abort`` is a failure.
    ended_by_update: bool = False
    # Tokens alone, after the request's first chunk: no finish reason, logprobs, counts,
    # decision, version or adapter (``decode_stream.DecodeStream`` marks each such decode
    # output, whichever way it goes out); the usual chunk of a stream, which
    # ``RequestOutput.consume`` takes in a few steps.
    plain: bool = False


class ChunkSink(Protocol):
    """Where a streamed request's chunks can be written the moment they arrive: from the
    worker session's reader itself, with no task woken and no generator layer per token
    (the HTTP side's is ``http/openai/stream_writer.StreamWriter``).

    The dispatcher offers it each ordinary decode chunk (tokens alone: not the request's
    first, not the last, no logprobs, no weights version, no failure; the first output of
    a call that computes the prompt is the task's) as the chunk arrives, only while
    ``accepting`` and only when the chunk would otherwise be the next one ``generate``
    yields (``accepting`` False: no chunk is made to offer). ``offer(chunk)`` returns
    whether it took the chunk: True, the chunk was consumed (written) and ``generate``
    never yields it; False, nothing was changed and ``generate`` yields it as usual. The
    chunk is the one ``generate`` would have yielded, and the dispatcher's bookkeeping
    for it (``decode_stream.DecodeStream``) is the same either way: done once, after
    the sink took it or as it is yielded.
    """

    accepting: bool

    def offer(self, chunk: TokenChunk) -> bool:
        ...


class NoWorkerAvailableError(RuntimeError):
    """No healthy worker can take the request (HTTP 503)."""


class WorkerFailedError(RuntimeError):
    """A worker failed the request and no fallback could finish it (HTTP 500,
    or an error event when the stream has already started)."""


class RequestRejectedError(ValueError):
    """A worker refused the request itself as invalid (a grammar its engine cannot
    compile, ...): HTTP 400, the worker's words; no other worker would take it."""


class DeadlineExceededError(RuntimeError):
    """The request's deadline passed before it finished (HTTP 504, or an error event
    when the stream has already started); every worker involved was told to abort."""


@dataclass(frozen=True)
class Deadline:
    """One deadline per request, end to end, fixed when the request arrives (the
    router's ``--request-timeout-s``, or less if the client asks). Every worker call
    gets what is *left* of it as its gRPC deadline, so prefill, decode and a decode
    retry together never outlast it; past it the client gets 504 (or, once streaming,
    an error event and ``[DONE]``). An instant on ``time.perf_counter()``'s clock."""

    at_s: float
    timeout_s: float  # what it was set to, for messages

    @classmethod
    def after(cls, timeout_s: float, start_s: float | None = None) -> Deadline:
        start = time.perf_counter() if start_s is None else start_s
        return cls(start + timeout_s, timeout_s)

    def remaining_s(self) -> float:
        return self.at_s - time.perf_counter()

    def exceeded(self, what: str) -> DeadlineExceededError:
        return DeadlineExceededError(
            f"the request's deadline ({self.timeout_s:g} s) passed during {what}")


class Dispatcher(Protocol):
    """Runs requests on the workers.

    ``generate`` is an async generator of chunks. Closing it early
    (``aclose()``, or cancellation of the task iterating it) aborts the request
    on every worker involved and frees their KV blocks; the dispatcher owns
    that cleanup. It raises ``NoWorkerAvailableError`` before the first chunk
    when no worker can serve, ``WorkerFailedError`` when a worker fails, and
    ``DeadlineExceededError`` when ``deadline`` passes, ``RequestRejectedError`` when a
    worker refuses the request as invalid.
    """

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: RequestTimeline | None = None, deadline: Deadline | None = None,
        affinity: str | None = None, sink: ChunkSink | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """``timeline`` (started when the request arrived) is marked as the request goes
        and recorded when it finishes; without one the dispatcher starts its own.
        ``deadline`` (fixed when the request arrived) bounds every worker call; without
        one the dispatcher's own request timeout starts now. ``affinity``: a decode
        worker's id (a sibling's ``decode_worker_id``) that computes this prompt itself,
        from the KV its prefix cache holds, while it is healthy (else placement decides).
        ``sink``: where the request's ordinary chunks may be written as they arrive
        (``ChunkSink``); a dispatcher may ignore it and yield every chunk."""
        ...

    def is_ready(self) -> bool:
        """True when at least one route (prefill+decode, or decode alone) is healthy."""
        ...
