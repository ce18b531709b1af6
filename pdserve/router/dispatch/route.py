"""Where one request runs, decided from one snapshot of every worker: placement
(``policies/placement.py``), then the disaggregation decision (``policies/disagg.py``),
or the decode worker a sibling request names (``affinity``). Each decision is counted
where the dispatcher's metrics, the prefix index and the demand window see it."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.core.handle import PoolSource, PushTarget
from pdserve.core.lora import WantedLora
from pdserve.router.dispatch.base import NoWorkerAvailableError
from pdserve.router.dispatch.metrics import DispatchMetrics
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.disagg import DisaggConfig, DisaggDecision, choose_disagg
from pdserve.router.dispatch.policies.placement import Choice, Placement, PlacementRequest
from pdserve.router.dispatch.prefix.routing import PendingPrefix, PrefixRouting
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool
from pdserve.router.dispatch.workers.state import WorkerState


@dataclass(frozen=True)
class Route:
    """Where a request goes, decided from one set of snapshots."""

    prefill: Worker | None  # None: decode computes the prompt (``disagg`` says why)
    decode: Worker
    disagg: DisaggDecision
    uncached_tokens: int = 0  # the prompt tokens not in prefill's prefix cache
    push_to: PushTarget | None = None
    pending: PendingPrefix | None = None  # what the prefill made pending in the prefix index
    pool_source: PoolSource | None = None  # the peer prefill pulls the prompt's head from
    decode_cached: int = 0  # the prompt tokens decode's own prefix cache holds


def _push_target(prefill: WorkerState, decode: WorkerState) -> PushTarget | None:
    """Have prefill push the KV layer by layer to decode, when both support it."""
    if not (prefill.kv_push and decode.kv_push and decode.kv_port):
        return None
    return PushTarget(host=decode.kv_host, port=decode.kv_port, transfer_id=uuid.uuid4().hex)


def _serving(workers: Sequence[Worker], lora: WantedLora
             ) -> tuple[list[Worker], list[WorkerState]]:
    """The workers that serve exactly ``lora`` (all for the base model), with the one
    snapshot of each that placement reads."""
    pairs = [(w, w.snapshot()) for w in workers]
    if lora is not None:
        pairs = [(w, s) for w, s in pairs if s.serves(lora)]
    return [w for w, _ in pairs], [s for _, s in pairs]


class RouteChooser:
    """Chooses each request's route; round-robin tie-breaks turn a cursor kept here."""

    def __init__(self, pool: WorkerPool, placement: Placement, metrics: DispatchMetrics,
                 prefix: PrefixRouting | None, disagg: DisaggConfig,
                 demand: DemandWindow | None) -> None:
        self._pool = pool
        self._placement = placement
        self._metrics = metrics
        self._prefix = prefix
        self._disagg = disagg
        self._demand = demand
        self._cursor = 0

    def follow(self, affinity: str | None, prompt: Sequence[int],
               lora: WantedLora = None) -> Route | None:
        """The route to the decode worker ``affinity`` names, while it is healthy and
        serves exactly ``lora`` (the request's adapter; None: the base model)."""
        for worker in self._pool.decode if affinity else ():
            state = worker.snapshot()
            if state.worker_id == affinity and state.healthy and state.serves(lora):
                disagg = DisaggDecision("local", "sibling")
                self._metrics.on_decision(disagg)
                self._metrics.placements.on_placed(state)
                if self._demand is not None:
                    self._demand.on_arrival(len(prompt))
                return Route(None, worker, disagg)
        return None

    def choose(self, prompt: Sequence[int], cache_salt: str | None = None,
               lora: WantedLora = None) -> Route:
        """Placement, then the disaggregation decision, over one snapshot of every
        worker, taken once per request (the prefix caches matched under its salt).
        Under a LoRA adapter only the workers serving exactly it (name and folder) are
        candidates (none: 503)."""
        prefill, p_states = _serving(self._pool.prefill, lora)
        decode, d_states = _serving(self._pool.decode, lora)
        request = (self._prefix.request(prompt, p_states, cache_salt, d_states)
                   if self._prefix is not None else PlacementRequest(len(prompt)))
        choice: Choice | None = self._placement.choose(p_states, d_states, self._cursor, request)
        self._cursor += 1
        if choice is None:
            raise NoWorkerAvailableError("no healthy decode worker is available")
        p_state = None if choice.prefill is None else p_states[choice.prefill]
        d_state = d_states[choice.decode]
        decode_cached = request.decode_cached_tokens(d_state)
        disagg = choose_disagg(self._disagg, request, p_state, d_state, decode_cached)
        self._metrics.on_decision(disagg)
        self._metrics.placements.on_placed(d_state)
        if self._prefix is not None:
            self._prefix.on_decode_placed(request.num_prompt_tokens, decode_cached)
        if choice.prefill is None or p_state is None or not disagg.remote:
            if self._demand is not None:
                self._demand.on_arrival(request.num_prompt_tokens - decode_cached)
            return Route(None, decode[choice.decode], disagg, decode_cached=decode_cached)
        if self._demand is not None:
            self._demand.on_arrival(request.uncached_tokens(p_state))
        self._metrics.placements.on_placed(p_state)
        pending = self._prefix.on_placed(request, p_state) if self._prefix is not None else None
        # Decode pulls only the blocks past what its cache holds; a push would send them all.
        push = None if decode_cached else _push_target(p_state, d_state)
        return Route(prefill[choice.prefill], decode[choice.decode], disagg,
                      request.uncached_tokens(p_state), push, pending,
                      request.pool_source(p_state), decode_cached)
