"""Decode failover mid-stream (request migration).

When the decode worker serving a request fails after tokens have reached the client
(its stream ends UNAVAILABLE, INTERNAL, ..., or with an ``error``/``abort`` finish the
router did not ask for), the request continues on another healthy decode worker: one
of the same compatibility hash if there is one, else, when the continuation computes
everything itself (no KV to load), one serving the same model in another dtype or
block size (a drained bf16 worker's stream goes on on a float32 one: a valid
continuation, bit-identical only within one dtype). The continuation's prompt is the
original prompt plus every token already sent, computed there as a local prefill
(decode alone, as the ``local`` route runs), with ``max_tokens`` reduced by the tokens
already produced. So nothing is sent twice and nothing is skipped, and with greedy
sampling the client's text equals an uninterrupted run's.

What carries over and what does not:
- Stop strings are matched by the router over the whole text, stop token ids by the
  engine on output tokens only (none of the tokens sent was one, or the request would
  have finished): neither needs adjusting.
- A request with a ``seed`` (or any sampled request) continues with a fresh generator
  on the new worker: its text is a valid sample, not the bit-for-bit one an
  uninterrupted run would have given.
- The weights version: the continuation names the request's (``PhaseRequest.weight_version``)
  and goes only to a worker serving it; a worker on another version refuses it anyway,
  so a response never mixes versions through a migration. With no worker left on that
  version (a refit switched them all), the request fails over as with no worker left,
  unless the refit itself ended it (``weights.py`` decides what then).
- A failure before the failed worker streamed anything (it died while loading the
  prefill's KV) keeps prefill's KV handle: the next worker pulls the KV (a push aimed
  at the dead one is lost) instead of recomputing the prompt.

Not migrated: the client's doing (a cancelled or closed iterator never reaches here),
a request the worker rejects (``INVALID_ARGUMENT``, ``FAILED_PRECONDITION``), and the
request's deadline (``DEADLINE_EXCEEDED``). ``--max-migrations`` bounds the attempts;
past it, or with no compatible worker left, the dispatcher raises ``WorkerFailedError``
(an SSE error event then ``[DONE]`` once the stream has started).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdserve.core.lora import wanted_lora
from pdserve.core.types import PhaseOutput, PhaseRequest
from pdserve.router.metrics import PREFIX, counter

if TYPE_CHECKING:  # flags.py reads the default from here without loading gRPC
    from pdserve.router.dispatch.workers.client import WorkerCallError
    from pdserve.router.dispatch.workers.pool import Worker

DEFAULT_MAX_MIGRATIONS = 3
# Status codes that say the worker (or the path to it) failed, not the request.
# CANCELLED reaches here only from the server side (a worker shutting down): the
# router's own cancellation surfaces as ``asyncio.CancelledError`` or ``GeneratorExit``.
MIGRATABLE_CODES = frozenset({"UNAVAILABLE", "INTERNAL", "UNKNOWN", "ABORTED", "CANCELLED",
                              "DATA_LOSS"})
# Finishes a worker reports for a request it could not complete.
_FAILED_FINISHES = ("error", "abort")


@dataclass(frozen=True)
class MigrationConfig:
    """``max_migrations``: how many times one request may move to another decode
    worker (0: never; a failed decode then fails the request)."""

    max_migrations: int = DEFAULT_MAX_MIGRATIONS

    def __post_init__(self) -> None:
        if self.max_migrations < 0:
            raise ValueError("max_migrations must be >= 0")


class MigrationMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.migrations = counter(
            registry, f"{PREFIX}migrations", "Requests moved to another decode worker after "
            "theirs failed, by what failed (a gRPC status, or finish_error/finish_abort).",
            ["reason"])
        self.failed = counter(
            registry, f"{PREFIX}migrations_failed", "Decode failures that could not be "
            "migrated: max_migrations reached, or no compatible healthy decode worker left.",
            ["reason"])
        for code in MIGRATABLE_CODES:  # bounded label sets exist from the start
            self.migrations.labels(code.lower())
        for reason in _FAILED_FINISHES:
            self.migrations.labels(f"finish_{reason}")
        for reason in ("max_migrations", "no_worker"):
            self.failed.labels(reason)


def failure_of_error(exc: WorkerCallError) -> str | None:
    """The migration reason for a failed decode call, or None if it must not migrate."""
    return exc.code.lower() if exc.code in MIGRATABLE_CODES else None


def failure_of_output(out: PhaseOutput) -> str | None:
    """The migration reason when a worker ends the request itself (``error``/``abort``);
    the tokens of such an output are not trusted and not sent (the next worker
    produces them again)."""
    reason = out.finish_reason
    return f"finish_{reason}" if reason in _FAILED_FINISHES else None


@dataclass(frozen=True)
class Continuation:
    """Where the request goes next: ``request`` on ``worker``; ``keeps_kv`` when it still
    loads prefill's KV (prefill must keep holding it)."""

    worker: Worker
    request: PhaseRequest
    keeps_kv: bool


class RequestMigration:
    """One request's failover state: the tokens sent so far (prefill's first token
    included), the workers that failed it, the migrations left. Owned by the task
    serving the request."""

    def __init__(self, config: MigrationConfig, metrics: MigrationMetrics,
                 prompt: Sequence[int], first: PhaseOutput | None) -> None:
        self._config = config
        self._metrics = metrics
        self._prompt = tuple(prompt)
        self._sent: list[int] = list(first.token_ids) if first is not None else []
        self._failed: list[Worker] = []
        self._sent_this_call = 0
        self.num_migrations = 0

    def on_sent(self, token_ids: Sequence[int]) -> None:
        """These tokens (an output's) went to the client."""
        self._sent.extend(token_ids)
        self._sent_this_call += len(token_ids)

    def next(self, failed: Worker, reason: str, request: PhaseRequest,
             candidates: Sequence[Worker]) -> Continuation | None:
        """The continuation after ``failed`` failed ``request`` (``reason``: a metric
        label), or None when the request already has all its tokens (it ends with
        ``length``). Raises ``MigrationRefused`` when it cannot go on."""
        self._failed.append(failed)
        remaining = request.sampling.max_tokens - self._sent_this_call
        if remaining <= 0:
            return None
        if self.num_migrations >= self._config.max_migrations:
            self._metrics.failed.labels("max_migrations").inc()
            raise MigrationRefused(f"max migrations ({self.num_migrations}) reached")
        keeps_kv = self._sent_this_call == 0 and request.kv_handle is not None
        # Only a worker serving exactly its adapter (name and folder) continues it, and
        # only under the request's weights version.
        lora = wanted_lora(request.sampling.lora_name, request.sampling.lora_path)
        worker = self._pick(failed, [w for w in candidates if w.snapshot().serves(lora)],
                            not keeps_kv, request.weight_version)
        if worker is None:
            self._metrics.failed.labels("no_worker").inc()
            raise MigrationRefused("no other compatible healthy decode worker")
        self.num_migrations += 1
        self._metrics.migrations.labels(reason).inc()
        self._sent_this_call = 0
        if keeps_kv:
            return Continuation(worker, _pull_instead(request), True)
        # Prompt logprobs went out with the first token: ask again only if none did.
        prompt_logprobs = request.sampling.prompt_logprobs if not self._sent else None
        sampling = replace(request.sampling, max_tokens=remaining,
                           prompt_logprobs=prompt_logprobs)
        return Continuation(worker, PhaseRequest(
            request.request_id, "decode", (*self._prompt, *self._sent), sampling,
            num_output_in_prompt=len(self._sent), weight_version=request.weight_version), False)

    def _pick(self, failed: Worker, candidates: Sequence[Worker], same_model: bool,
              version: str) -> Worker | None:
        """The least busy healthy worker that has not failed this request and serves
        its weights ``version`` ("": any): of ``failed``'s compatibility hash, else
        (``same_model``: nothing to load) of its model."""
        was = failed.snapshot()
        states = [(w, w.snapshot()) for w in candidates if w not in self._failed]
        healthy = [(s.num_assigned, i, w, s) for i, (w, s) in enumerate(states)
                   if s.healthy and (not version or s.weight_version == version)]
        ok = [t for t in healthy if t[3].compatibility_hash == was.compatibility_hash]
        if not ok and same_model and was.model:
            ok = [t for t in healthy if t[3].model == was.model]
        return min(ok, key=lambda t: t[:2])[2] if ok else None


class MigrationRefused(RuntimeError):
    """The failed request cannot move on (the message says why)."""


def _pull_instead(request: PhaseRequest) -> PhaseRequest:
    """The KV was pushed to a decode worker that died: the next one pulls it."""
    handle = request.kv_handle
    if handle is None:
        return request
    return replace(request, kv_handle=replace(handle, pushed=False))
