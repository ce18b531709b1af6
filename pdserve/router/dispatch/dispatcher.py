"""Runs a request on the workers: on the route ``route.py`` chooses, prefill on P (first
token + KV handle), then decode on D with the handle (``remote``), or decode alone
computing the prompt (``local``); falls back to decode alone when prefill fails. Each
phase call is ``phases.py``'s; a weight update that ends a request before its first
chunk runs it again (``weights.versioned``).

Cleanup is owned here: however the chunk iterator ends (finished, closed by the
HTTP layer, cancelled), the gRPC calls are cancelled and each worker involved is
told to abort (``phases.Aborts``), which also releases the KV blocks prefill holds.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from dataclasses import replace

from prometheus_client import CollectorRegistry

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION, versioned_salt
from pdserve.core.lora import adapter_salt, wanted_lora
from pdserve.core.types import PhaseOutput, PhaseRequest, SamplingSpec
from pdserve.router.dispatch.base import ChunkSink, Deadline, TokenChunk
from pdserve.router.dispatch.decode_stream import DecodeStream
from pdserve.router.dispatch.lora_catalog import LoraCatalog, lora_tag, refit_folder
from pdserve.router.dispatch.metrics import DispatchMetrics
from pdserve.router.dispatch.migration import (
    MigrationConfig,
    MigrationMetrics,
    RequestMigration,
)
from pdserve.router.dispatch.phases import Aborts, Phases
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import Placement
from pdserve.router.dispatch.prefix.routing import PrefixRouting
from pdserve.router.dispatch.route import RouteChooser
from pdserve.router.dispatch.timeline import RequestTimeline, TimelineRecorder
from pdserve.router.dispatch.weight_board import WeightBoard
from pdserve.router.dispatch.weights import Ticket, WeightGate, versioned
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool


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


def _rest(sampling: SamplingSpec, sent: Sequence[int]) -> SamplingSpec:
    """A kept request's sampling when it goes on after ``sent`` tokens (its prompt
    logprobs went out with the first chunk)."""
    if not sent:
        return sampling
    return replace(sampling, max_tokens=sampling.max_tokens - len(sent), prompt_logprobs=None)


async def _tagged(chunks: AsyncGenerator[TokenChunk, None], adapter: str
                  ) -> AsyncGenerator[TokenChunk, None]:
    """``chunks``, the first naming the adapter folder that gives them (a LoRA request's)."""
    async with contextlib.aclosing(chunks):
        first = True
        async for chunk in chunks:
            yield replace(chunk, adapter=adapter) if first else chunk
            first = False


class PDDispatcher:
    def __init__(
        self, pool: WorkerPool, placement: Placement, registry: CollectorRegistry | None,
        request_timeout_s: float = 600.0, prefix: PrefixRouting | None = None,
        disagg: DisaggConfig | None = None, migration: MigrationConfig | None = None,
        demand: DemandWindow | None = None, weight_board: WeightBoard | None = None,
    ) -> None:
        """``demand``: where each request's prompt and output tokens are counted (the
        planner's measure of the offered load). ``weight_board``: the weights state the
        router's processes share (None: this process alone)."""
        self._pool = pool
        self._demand = demand
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
        self.weights = WeightGate(board=weight_board or WeightBoard.local())
        # The LoRA adapters served: which ``model`` names one, its folder, the fan-out.
        self.loras = LoraCatalog(pool)
        self._aborts = Aborts()
        self._phases = Phases(pool, self._metrics, prefix, self._aborts)

    def is_ready(self) -> bool:
        return any(w.snapshot().healthy for w in self._pool.decode)

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: RequestTimeline | None = None, deadline: Deadline | None = None,
        affinity: str | None = None, sink: ChunkSink | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        """The request's chunks, all from the weights version it was admitted under
        (``weights.py``): the first names it. A weight update that ends the request
        before any chunk went out runs it again on the new version; after, it ends
        with finish reason ``abort``. Each run checks its adapter's folder again
        (``lora_catalog.refit_folder``: an adapter refit while it waited at the gate, or
        was kept) and names it on its first chunk (the response's spans)."""
        deadline = deadline or Deadline.after(self._timeout)

        def attempt(ticket: Ticket, sent: tuple[int, ...]) -> AsyncGenerator[TokenChunk, None]:
            current = refit_folder(sampling, self.loras)
            chunks = self._generate(request_id, (*prompt_token_ids, *sent),
                                    _rest(current, sent), timeline, deadline, affinity,
                                    sink, ticket)
            tag = lora_tag(current)
            return chunks if tag is None else _tagged(chunks, tag)

        chunks = versioned(self.weights, request_id, deadline, attempt,
                           self._metrics.weight_reruns.inc)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                yield chunk

    async def _generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: RequestTimeline | None, deadline: Deadline, affinity: str | None,
        sink: ChunkSink | None, ticket: Ticket,
    ) -> AsyncGenerator[TokenChunk, None]:
        timeline = timeline or RequestTimeline(request_id)
        # The request's exact adapter (name and folder, fixed when it arrived): routing,
        # the n>1 sibling and migrations place it only where that adapter is served.
        lora = wanted_lora(sampling.lora_name, sampling.lora_path)
        salt = adapter_salt(sampling.cache_salt,
                            self.loras.adapter(lora) if isinstance(lora, str) else lora)
        route = (self._routes.follow(affinity, prompt_token_ids, lora)
                 or self._routes.choose(prompt_token_ids, versioned_salt(
                     salt, ticket.version or DEFAULT_WEIGHT_VERSION), lora))
        involved: list[Worker] = []
        finished = False
        sent_before = len(ticket.tokens)  # this run's tokens follow (the sink's too)
        try:
            first: PhaseOutput | None = None
            if route.prefill is not None:
                involved.append(route.prefill)
                timeline.on_call()
                first = await self._phases.prefill(route.prefill, PhaseRequest(
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
                ticket.tokens.extend(first.token_ids)
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
            stream = DecodeStream(timeline, migration, ticket,
                                  route.disagg if first is None else None, sink)
            chunks = self._phases.decode(route.decode, _decode_request(
                request_id, prompt_token_ids, sampling, first, ticket.version),
                involved, stream, migration, deadline, ticket, route.decode_cached)
            async with contextlib.aclosing(chunks):  # closing us closes the decode call now
                async for chunk in chunks:
                    if chunk.finish_reason is not None:
                        finished = True
                    yield chunk
        finally:
            if finished:
                self._timelines.record(timeline)
            else:
                self._aborts.later(request_id, involved)
            if self._demand is not None:
                self._demand.on_finished(len(ticket.tokens) - sent_before)

