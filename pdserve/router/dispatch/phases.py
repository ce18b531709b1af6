"""The two phases of a request on its workers: the prefill call (its one output: first
token + KV handle) and the decode call, continued on another decode worker when one
fails mid-stream (``migration.py`` says when and with what request). Each call gets what
is left of the request's ``Deadline`` as its gRPC deadline and reports its outcome to the
worker's circuit breaker; ``Aborts`` tells workers to drop what a request left there."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator

from pdserve.core.types import PhaseOutput, PhaseRequest
from pdserve.router.dispatch.base import (
    Deadline,
    DeadlineExceededError,
    RequestRejectedError,
    TokenChunk,
    WorkerFailedError,
)
from pdserve.router.dispatch.decode_stream import DecodeStream
from pdserve.router.dispatch.metrics import DispatchMetrics
from pdserve.router.dispatch.migration import (
    Continuation,
    MigrationRefused,
    RequestMigration,
    failure_of_error,
    failure_of_output,
)
from pdserve.router.dispatch.prefix.routing import PendingPrefix, PrefixRouting
from pdserve.router.dispatch.weights import Ticket, UpdateAborted
from pdserve.router.dispatch.workers.client import (
    DEADLINE_EXCEEDED,
    INVALID_ARGUMENT,
    UNAVAILABLE,
    WorkerCallError,
)
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool

logger = logging.getLogger("pdserve.router.dispatch")

_ABORT_TIMEOUT_S = 5.0
# Only "cannot reach" takes a worker out of placement; a slow request's deadline does not.
_UNREACHABLE = {UNAVAILABLE}


class Aborts:
    """Tells workers to abort a request that will not finish there, from tasks of its
    own (this runs while the request's own task is being cancelled); keeps them until
    they end."""

    def __init__(self) -> None:
        self._cleanups: set[asyncio.Task[None]] = set()

    def later(self, request_id: str, workers: list[Worker]) -> None:
        """Abort ``request_id`` on every worker in ``workers``, in the background."""
        task = asyncio.get_running_loop().create_task(self._abort(request_id, workers))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort(self, request_id: str, workers: list[Worker]) -> None:
        await asyncio.gather(*(self._abort_one(request_id, w) for w in workers))

    async def _abort_one(self, request_id: str, worker: Worker) -> None:
        try:
            await worker.client.abort(request_id, _ABORT_TIMEOUT_S)
        except WorkerCallError as exc:
            logger.warning("abort of %s on %s failed: %s", request_id, worker.client.endpoint,
                           exc.code)


class Phases:
    """Runs each phase call of a request on the worker placement chose."""

    def __init__(self, pool: WorkerPool, metrics: DispatchMetrics,
                 prefix: PrefixRouting | None, aborts: Aborts) -> None:
        self._pool = pool
        self._metrics = metrics
        self._prefix = prefix
        self._aborts = aborts

    async def prefill(self, worker: Worker, request: PhaseRequest, deadline: Deadline,
                       uncached_tokens: int, pending: PendingPrefix | None = None,
                       ticket: Ticket | None = None) -> PhaseOutput | None:
        """The prefill's one output, or None if prefill failed (decode falls back);
        raises ``UpdateAborted`` when a weight update ended it."""
        timeout_s = self._time_left(deadline, "prefill")
        worker.on_sent(uncached_tokens)
        last: PhaseOutput | None = None
        try:
            async with contextlib.aclosing(worker.client.generate(request, timeout_s)) as outs:
                async for out in outs:
                    last = out
            worker.on_call_succeeded()
            if ticket is not None and ticket.aborted:
                raise UpdateAborted(request.request_id)
            if last is not None and last.finish_reason == "abort":
                # Not this router's abort (that closes the call): the worker ended it (a
                # role switch past its drain). Decode computes the prompt instead.
                logger.warning("prefill of %s aborted on %s; decode prefills it",
                               request.request_id, worker.client.endpoint)
                return None
            if last is not None and self._prefix is not None:
                self._prefix.on_prefilled(last.num_cached_tokens)
            return last
        except WorkerCallError as exc:
            if ticket is not None and ticket.aborted:
                raise UpdateAborted(request.request_id) from exc
            self._on_error(worker, exc)
            if exc.code == DEADLINE_EXCEEDED:
                raise self._expired(deadline, "prefill") from exc
            if exc.code == INVALID_ARGUMENT:
                raise RequestRejectedError(exc.details) from exc
            return None
        finally:
            worker.on_finished(uncached_tokens)
            if self._prefix is not None and (last is None
                                             or last.finish_reason in ("abort", "error")):
                self._prefix.on_prefill_failed(pending)  # its blocks will not be computed

    async def decode(
        self, worker: Worker, request: PhaseRequest, involved: list[Worker],
        stream: DecodeStream, migration: RequestMigration, deadline: Deadline,
        ticket: Ticket, cached_tokens: int = 0,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Decode on ``worker``; if it fails, on another (``migration.py`` says when and
        with what request), each call with what is left of the request's ``deadline``.
        ``cached_tokens``: the prompt tokens ``worker``'s prefix cache holds (it computes
        only the rest when it prefills locally). ``stream`` makes each output a chunk
        (``decode_stream.py``): the ones yielded here, and those the request's sink takes
        from the session's reader (``stream.tap``), which are not."""
        while True:
            failure: str | None = None
            ended = False  # the finish went out: a failure after it loses nothing
            timeout_s = self._time_left(deadline, "decode")
            # Prompt tokens decode computes before its first token (none with a KV handle):
            # queued local prefill, which the SLO decisions weigh, until that token.
            prefill_tokens = 0 if request.kv_handle is not None else max(
                len(request.prompt_token_ids) - cached_tokens, 1)
            cached_tokens = 0  # a worker it migrates to holds none of it
            worker.on_sent(prefill_tokens)
            stream.call(worker.snapshot().worker_id, prefill_tokens > 0)
            try:
                async with contextlib.aclosing(
                        worker.client.generate(request, timeout_s, stream.tap)) as outs:
                    async for out in outs:
                        if prefill_tokens:
                            worker.on_prefilled(prefill_tokens)
                            prefill_tokens = 0
                        if (failure := failure_of_output(out)) is not None:
                            break
                        chunk = stream.chunk(out)
                        ended = chunk.finish_reason is not None
                        yield chunk
                worker.on_call_succeeded()
            except WorkerCallError as exc:
                if ticket.aborted and not ended:
                    raise UpdateAborted(request.request_id) from exc
                self._on_error(worker, exc)
                if ended:
                    return
                if exc.code == DEADLINE_EXCEEDED:
                    raise self._expired(deadline, "decode") from exc
                if exc.code == INVALID_ARGUMENT:
                    raise RequestRejectedError(exc.details) from exc
                if (failure := failure_of_error(exc)) is None:
                    raise WorkerFailedError(f"decode worker failed: {exc.details}") from exc
            finally:
                worker.on_finished(prefill_tokens)
            if failure is None:
                return
            if ticket.aborted:  # never continued elsewhere: that could be other weights
                raise UpdateAborted(request.request_id)
            step = self._migrate(worker, failure, request, involved, migration)
            if step is None:  # every token was sent: only the end was lost
                yield TokenChunk((), "length")
                return
            worker, request = step.worker, step.request
            stream.on_migrated()

    def _migrate(self, failed: Worker, reason: str, request: PhaseRequest,
                 involved: list[Worker], migration: RequestMigration) -> Continuation | None:
        """Where the request goes after ``failed`` failed it (None: nowhere, it has every
        token). The failed worker is told to abort now, and so is
        prefill once its KV is no longer going to be loaded (its lease is released)."""
        logger.warning("decode of %s on %s failed (%s)", request.request_id,
                       failed.snapshot().endpoint, reason)
        try:
            step = migration.next(failed, reason, request, self._pool.decode)
        except MigrationRefused as exc:
            raise WorkerFailedError(f"decode worker failed ({reason}): {exc}") from exc
        done = involved if step is None or not step.keeps_kv else [failed]
        self._aborts.later(request.request_id, list(done))
        involved[:] = [w for w in involved if w not in done]
        if step is not None:
            involved.append(step.worker)
        return step

    def _time_left(self, deadline: Deadline, phase: str) -> float:
        """The gRPC deadline of the ``phase`` call: what is left of the request's."""
        remaining = deadline.remaining_s()
        if remaining <= 0:
            raise self._expired(deadline, phase)
        return remaining

    def _expired(self, deadline: Deadline, phase: str) -> DeadlineExceededError:
        self._metrics.deadlines_exceeded.labels(phase).inc()
        return deadline.exceeded(phase)

    def _on_error(self, worker: Worker, exc: WorkerCallError) -> None:
        state = worker.snapshot()
        self._metrics.worker_errors.labels(state.role, exc.code).inc()
        logger.warning("%s worker %s: %s %s", state.role, state.endpoint, exc.code, exc.details)
        if exc.code in _UNREACHABLE:
            worker.mark_unhealthy(exc.code)
        if worker.on_call_failed(exc.code):
            self._metrics.ejections.labels(state.role).inc()
