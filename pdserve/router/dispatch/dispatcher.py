"""Runs a request on the workers: prefill on P (first token + KV handle), then
decode on D with the handle (``remote``), or decode alone computing the prompt
(``local``), on the route ``route.py`` chooses per request; falls back to decode
alone when prefill fails.

Cleanup is owned here: however the chunk iterator ends (finished, closed by the
HTTP layer, cancelled), the gRPC calls are cancelled and each worker involved is
told to abort, which also releases the KV blocks prefill holds.

Each call gets what is left of the request's ``Deadline`` as its gRPC deadline; when it
passes, the request ends with ``DeadlineExceededError`` (no fallback: no time is left).
Each call's outcome goes to its worker's circuit breaker (``on_call_failed`` /
``on_call_succeeded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION, versioned_salt
from pdserve.core.types import PhaseOutput, PhaseRequest, SamplingSpec
from pdserve.router.dispatch.base import (
    Deadline,
    DeadlineExceededError,
    Express,
    RequestRejectedError,
    TokenChunk,
    WorkerFailedError,
)
from pdserve.router.dispatch.metrics import DispatchMetrics
from pdserve.router.dispatch.migration import (
    Continuation,
    MigrationConfig,
    MigrationMetrics,
    MigrationRefused,
    RequestMigration,
    failure_of_error,
    failure_of_output,
)
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.disagg import DisaggConfig, DisaggDecision
from pdserve.router.dispatch.policies.placement import Placement
from pdserve.router.dispatch.prefix.routing import PendingPrefix, PrefixRouting
from pdserve.router.dispatch.route import RouteChooser
from pdserve.router.dispatch.timeline import RequestTimeline, TimelineRecorder
from pdserve.router.dispatch.weights import Ticket, UpdateAborted, WeightGate, versioned
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


def _decode_request(request_id: str, prompt: Sequence[int], sampling: SamplingSpec,
                    first: PhaseOutput | None, version: str) -> PhaseRequest:
    """Decode's request: the prompt alone (fallback), or prompt + prefill's tokens
    with its KV handle and the tokens still to generate."""
    if first is None:
        return PhaseRequest(request_id, "decode", tuple(prompt), sampling,
                            weight_version=version)
    return PhaseRequest(
        request_id, "decode", (*prompt, *first.token_ids),
        replace(sampling, max_tokens=sampling.max_tokens - len(first.token_ids),
                prompt_logprobs=None),  # prefill computed the prompt and returned them
        kv_handle=first.kv_handle, num_output_in_prompt=len(first.token_ids),
        weight_version=version)


class PDDispatcher:
    def __init__(
        self, pool: WorkerPool, placement: Placement, registry: CollectorRegistry | None,
        request_timeout_s: float = 600.0, prefix: PrefixRouting | None = None,
        disagg: DisaggConfig | None = None, migration: MigrationConfig | None = None,
        demand: DemandWindow | None = None,
    ) -> None:
        """``demand``: where each request's prompt and output tokens are counted (the
        planner's measure of the offered load)."""
        self._pool = pool
        self._demand = demand
        self._prefix = prefix
        self._migration = migration or MigrationConfig()
        self._migration_metrics = MigrationMetrics(registry)
        self._metrics = DispatchMetrics(registry, placement.name)
        for worker in pool.all:  # static members joined before the dispatcher existed
            self._metrics.placements.on_joined(worker.snapshot())
        pool.on_worker_added(self._metrics.placements.on_joined)
        pool.on_worker_removed(self._metrics.placements.forget)
        pool.on_worker_renamed(self._metrics.placements.on_renamed)
        self._routes = RouteChooser(pool, placement, self._metrics, prefix,
                                    disagg or DisaggConfig(), demand)
        self._timelines = TimelineRecorder(registry)
        self._timeout = request_timeout_s
        # The weights version requests run under, and the gate an update closes.
        self.weights = WeightGate()
        self._cleanups: set[asyncio.Task[None]] = set()

    def is_ready(self) -> bool:
        return any(w.snapshot().healthy for w in self._pool.decode)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: RequestTimeline | None = None, deadline: Deadline | None = None,
        affinity: str | None = None, express: Express | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks, all from the weights version it was admitted under
        (``weights.py``): the first names it. A weight update that ends the request
        before any chunk went out runs it again on the new version; after, it ends
        with finish reason ``abort``."""
        deadline = deadline or Deadline.after(self._timeout)
        chunks = versioned(self.weights, request_id, deadline, lambda ticket: self._generate(
            request_id, prompt_token_ids, sampling, timeline, deadline, affinity, express,
            ticket), self._metrics.weight_reruns.inc)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: RequestTimeline | None, deadline: Deadline, affinity: str | None,
        express: Express | None, ticket: Ticket,
    ) -> AsyncGenerator[TokenChunk, None]:
        timeline = timeline or RequestTimeline(request_id)
        route = (self._routes.follow(affinity, prompt_token_ids)
                 or self._routes.choose(prompt_token_ids, versioned_salt(
                     sampling.cache_salt, ticket.version or DEFAULT_WEIGHT_VERSION)))
        involved: list[Worker] = []
        finished = False
        num_tokens = 0
        try:
            first: PhaseOutput | None = None
            if route.prefill is not None:
                involved.append(route.prefill)
                timeline.on_call()
                first = await self._prefill(route.prefill, PhaseRequest(
                    request_id, "prefill", tuple(prompt_token_ids), sampling,
                    push_target=route.push_to, pool_source=route.pool_source,
                    weight_version=ticket.version), deadline,
                    route.uncached_tokens, route.pending, ticket)
                if first is None:  # a remote decision whose prefill failed
                    self._metrics.fallbacks.inc()
            if first is not None:
                timeline.on_prefill(first)
                done = first.finish_reason in ("stop", "abort", "error") or (
                    sampling.max_tokens <= 1)
                num_tokens += len(first.token_ids)
                yield TokenChunk(first.token_ids, first.finish_reason if done else None,
                                 first.num_cached_tokens, route.disagg, first.logprobs,
                                 first.prompt_logprobs,
                                 weight_version=first.weight_version or None)
                if done:  # nothing is held: prefill keeps KV only for a decode to come
                    finished = True
                    return
                if (handle := first.kv_handle) is not None:
                    self._metrics.handoffs.labels(handle.transport,
                                                  "push" if handle.pushed else "pull").inc()
            involved.append(route.decode)
            timeline.on_call()
            migration = RequestMigration(self._migration, self._migration_metrics,
                                         prompt_token_ids, first)
            stream = self._decode(route.decode, _decode_request(
                request_id, prompt_token_ids, sampling, first, ticket.version),
                route.disagg if first is None else None, involved, timeline, migration,
                deadline, ticket, express, route.decode_cached)
            async with contextlib.aclosing(stream):  # closing us closes the decode call now
                async for chunk in stream:
                    num_tokens += len(chunk.token_ids)
                    if chunk.finish_reason is not None:
                        finished = True
                    yield chunk
        finally:
            if finished:
                self._timelines.record(timeline)
            else:
                self._abort_later(request_id, involved)
            if self._demand is not None:
                self._demand.on_finished(num_tokens + (express.taken if express else 0))

    async def _prefill(self, worker: Worker, request: PhaseRequest, deadline: Deadline,
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

    async def _decode(
        self, worker: Worker, request: PhaseRequest, opening: DisaggDecision | None,
        involved: list[Worker], timeline: RequestTimeline, migration: RequestMigration,
        deadline: Deadline, ticket: Ticket, express: Express | None = None,
        cached_tokens: int = 0,
    ) -> AsyncGenerator[TokenChunk, None]:
        """Decode on ``worker``; if it fails, on another (``migration.py`` says when and
        with what request), each call with what is left of the request's ``deadline``.
        ``cached_tokens``: the prompt tokens ``worker``'s prefix cache holds (it computes
        only the rest when it prefills locally).
        ``opening`` is set when decode's first chunk opens the request (no prefill chunk
        came before it): that chunk carries decode's cached tokens and it. ``express``:
        the request's lane (``base.Express``), offered each ordinary output with the
        bookkeeping this loop does for it (``tap``)."""

        tap: Callable[[tuple[int, ...]], bool] | None = None
        if express is not None:
            lane = express

            def tap_lane(token_ids: tuple[int, ...]) -> bool:  # an output of tokens alone
                sink = lane.sink
                if sink is None or prefill_tokens or opening is not None or not sink(token_ids):
                    return False
                timeline.on_decode_tokens(len(token_ids))
                migration.on_sent(token_ids)
                lane.taken += len(token_ids)
                return True

            tap = tap_lane
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
            worker_id = worker.snapshot().worker_id
            try:
                async with contextlib.aclosing(
                        worker.client.generate(request, timeout_s, tap)) as outs:
                    async for out in outs:
                        if prefill_tokens:
                            worker.on_prefilled(prefill_tokens)
                            prefill_tokens = 0
                        if (failure := failure_of_output(out)) is not None:
                            break
                        timeline.on_decode(out)
                        migration.on_sent(out.token_ids)
                        cached = out.num_cached_tokens if opening is not None else None
                        chunk = TokenChunk(out.token_ids, out.finish_reason, cached, opening,
                                           out.logprobs, out.prompt_logprobs, worker_id,
                                           out.weight_version or None)
                        opening, ended = None, out.finish_reason is not None
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
            timeline.on_migrated()

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
        self._abort_later(request.request_id, list(done))
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

    def _abort_later(self, request_id: str, workers: list[Worker]) -> None:
        """Abort on every worker involved, from a task of its own: this runs while
        the request's own task is being cancelled."""
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
