"""Placement policies: pure functions from worker snapshots to a choice.

A policy reads ``WorkerState`` snapshots and returns indices; it never routes
or mutates. Its only state (a round-robin cursor) changes through ``advance``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.core.handle import PoolSource
from pdserve.router.dispatch.policies.link_cost import transfer_s
from pdserve.router.dispatch.policies.load_plan import LoadPlan
from pdserve.router.dispatch.workers.state import WorkerState


@dataclass(frozen=True)
class Choice:
    prefill: int | None  # index into the prefill list; None = no prefill (aggregated fallback)
    decode: int


@dataclass(frozen=True)
class PlacementRequest:
    """What placement knows about the request: its prompt length and, per worker id
    (prefill and decode), how many leading prompt tokens the prefix index says it holds or is
    computing for a prefill in flight (``matched_tokens``), and how many of those
    are only the latter (``pending_tokens``); how many its KV tiers hold
    (``tier_tokens``: ``{"host": n, "disk": n, "store": n}``, loadable tokens only;
    ``store``: the cluster KV store the worker loads from), and, for the workers that
    would load tokens from a tier, the store or a peer's host tier (the pool), how and
    at what cost (``load_plans``, ``load_plan.py``)."""

    num_prompt_tokens: int = 0
    matched_tokens: Mapping[str, int] = field(default_factory=dict)
    pending_tokens: Mapping[str, int] = field(default_factory=dict)
    # The prompt's block hashes per block size, for the hook that records the
    # placement (``PrefixRouting.on_placed``); policies do not read them.
    block_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict, compare=False)
    tier_tokens: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    load_plans: Mapping[str, LoadPlan] = field(default_factory=dict)

    def uncached_tokens(self, worker: WorkerState) -> int:
        """The prompt's cost on ``worker`` in computed tokens: those outside its prefix
        cache, the ones it would load from a tier or the pool at their cost ratio."""
        plan = self.load_plans.get(worker.worker_id) if self.load_plans else None
        if plan is not None:
            return plan.cost_tokens
        return self.num_prompt_tokens - self.matched_tokens.get(worker.worker_id, 0)

    def decode_cached_tokens(self, decode: WorkerState) -> int:
        """The prompt tokens ``decode``'s own prefix cache holds (a conversation's earlier
        turns): what it need neither compute nor load."""
        return self.matched_tokens.get(decode.worker_id, 0)

    def pool_source(self, worker: WorkerState) -> PoolSource | None:
        """The peer ``worker`` would pull the prompt's leading blocks from, if any."""
        plan = self.load_plans.get(worker.worker_id) if self.load_plans else None
        return None if plan is None else plan.pool_source


_NO_REQUEST = PlacementRequest()


class Placement(Protocol):
    name: str

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int,
        request: PlacementRequest = _NO_REQUEST,
    ) -> Choice | None:
        """A (prefill, decode) pair among healthy, compatible workers, or None.

        A pure function of its arguments: it reads the snapshots, never mutates
        them, and returns the same choice for the same inputs. ``cursor`` (the
        dispatcher's request counter) breaks ties by rotation.
        """
        ...


def _pairs(prefill: Sequence[WorkerState], decode: Sequence[WorkerState]) -> tuple[
        list[int], list[int]]:
    p = [i for i, w in enumerate(prefill) if w.healthy]
    d = [i for i, w in enumerate(decode) if w.healthy]
    return p, d


def _compatible(prefill: WorkerState, decode: WorkerState) -> bool:
    return prefill.compatibility_hash == decode.compatibility_hash


class RoundRobinPlacement:
    name = "round_robin"

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int,
        request: PlacementRequest = _NO_REQUEST,
    ) -> Choice | None:
        p, d = _pairs(prefill, decode)
        if not d:
            return None
        di = d[cursor % len(d)]
        compatible = [i for i in p if _compatible(prefill[i], decode[di])]
        pi = compatible[cursor % len(compatible)] if compatible else None
        return Choice(pi, di)


def _load(w: WorkerState) -> tuple[float, float]:
    busy = w.num_assigned + w.load.num_waiting_reqs
    return (busy, w.load.kv_cache_usage)


class LeastLoadedPlacement:
    name = "least_loaded"

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int,
        request: PlacementRequest = _NO_REQUEST,
    ) -> Choice | None:
        p, d = _pairs(prefill, decode)
        if not d:
            return None
        di = min(d, key=lambda i: (_load(decode[i]), (i - cursor) % len(decode)))
        compatible = [i for i in p if _compatible(prefill[i], decode[di])]
        if not compatible:
            return Choice(None, di)
        pi = min(compatible, key=lambda i: (_load(prefill[i]), (i - cursor) % len(prefill)))
        return Choice(pi, di)


@dataclass(frozen=True)
class CacheAwareConfig:
    # Fixed cost of one queued or running prefill, in prompt-token equivalents
    # (a forward pass has overhead beyond its tokens).
    request_cost_tokens: int = 128
    # What one more request running on a decode worker costs against the prompt tokens
    # it would not have to compute or load (its prefix cache holds them), in the same
    # units: one KV block of 128 tokens per request. A decode worker that holds a
    # conversation's 1,000 earlier tokens keeps its next turn until it runs about 8 more
    # requests than the least loaded one. A starting point, not a measurement.
    decode_request_cost_tokens: int = 128
    # Add each prefill's path to the decode the request will go to, priced as
    # ``link_cost`` prices it and counted in that prefill's prompt tokens (the seconds it
    # takes per token): a prefill behind a thin link loses long prompts to one behind a
    # faster link. Only where some decode worker has measured a path (``kv_links``).
    link_aware: bool = True

    def __post_init__(self) -> None:
        if self.request_cost_tokens < 0 or self.decode_request_cost_tokens < 0:
            raise ValueError("request_cost_tokens and decode_request_cost_tokens must be >= 0")


class CacheAwarePlacement:
    """Prefill: the lowest cost = uncached prompt tokens on that worker + the
    uncached tokens of prefills already sent to it + ``request_cost_tokens`` per
    request queued or running there. Ties: fewer queued requests, then rotation.
    Decode: least loaded (queued requests, then KV usage) among the compatible.

    Pending prefix tokens (a prefill in flight on the worker is computing them)
    are not counted as that worker's queued work: the request shares that work
    rather than adding to it. Counting it would make a second request with the
    same new prefix cost prefix + queue on the worker computing it against prefix
    alone on an idle one, so the pool would compute the prefix twice (and every
    further copy of the burst once per worker). With the credit, a new prefix
    stays on one worker until its other queued work (``request_cost_tokens`` per
    request, suffixes) exceeds computing the prefix elsewhere. The credit is at
    most the worker's queued tokens: a finished prefill whose KV event has not
    arrived leaves nothing to share.

    Prompt tokens a worker would load from its KV tiers or a peer's (the pool) count at
    their measured cost ratio (``request.uncached_tokens``, ``load_plan.py``), so a
    worker whose host tier holds the prefix is nearly as cheap as one whose engine does.

    With ``link_aware`` and a decode worker that has measured its paths, the decode is
    chosen first and each prefill's cost adds moving the prompt's KV to it over their
    path (``link_cost.transfer_s``), in that prefill's per-token compute time."""

    name = "cache_aware"

    def __init__(self, config: CacheAwareConfig | None = None) -> None:
        self.config = config or CacheAwareConfig()

    def cost(self, worker: WorkerState, request: PlacementRequest) -> int:
        shared = min(request.pending_tokens.get(worker.worker_id, 0),
                     worker.num_assigned_tokens)
        return (request.uncached_tokens(worker) + worker.num_assigned_tokens - shared
                + self.config.request_cost_tokens * _queued(worker))

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int,
        request: PlacementRequest = _NO_REQUEST,
    ) -> Choice | None:
        d = [i for i, w in enumerate(decode) if w.healthy]
        if not d:
            return None
        toward = (self._decode(decode, d, cursor, request)
                  if self.config.link_aware and any(decode[i].load.kv_links for i in d)
                  else None)
        pi = self._cheapest(prefill, {decode[i].compatibility_hash for i in d}, cursor, request,
                            None if toward is None else decode[toward])
        if pi is not None:
            d = [i for i in d if _compatible(prefill[pi], decode[i])]
        if toward is not None and toward in d:
            return Choice(pi, toward)
        return Choice(pi, self._decode(decode, d, cursor, request))

    def decode_cost(self, worker: WorkerState, request: PlacementRequest) -> int:
        return (request.num_prompt_tokens - request.decode_cached_tokens(worker)
                + worker.num_assigned_tokens
                + self.config.decode_request_cost_tokens * _queued(worker))

    def _decode(self, decode: Sequence[WorkerState], candidates: list[int], cursor: int,
                request: PlacementRequest) -> int:
        matched = request.matched_tokens
        if not matched or not any(decode[i].worker_id in matched for i in candidates):
            return _least_loaded(decode, candidates, cursor)
        n = len(decode)
        return min(candidates, key=lambda i: (self.decode_cost(decode[i], request),
                                              _load(decode[i]), (i - cursor) % n))

    def _cheapest(self, prefill: Sequence[WorkerState], compat: set[str], cursor: int,
                  request: PlacementRequest, toward: WorkerState | None = None) -> int | None:
        """The healthy, pairable prefill worker of lowest ``cost`` (inlined: this loop is
        the decision's hot path), ties by fewer queued requests, then rotation; plus each
        one's path to ``toward`` (the decode chosen first, where paths are priced)."""
        matched, total = request.matched_tokens, request.num_prompt_tokens
        pending, plans = request.pending_tokens, request.load_plans
        per_request, n = self.config.request_cost_tokens, len(prefill)
        best: int | None = None
        best_cost = best_queued = 0
        for i, w in enumerate(prefill):
            if not w.healthy or w.compatibility_hash not in compat:
                continue
            load = w.load
            queued = max(w.num_assigned, load.num_running_reqs + load.num_waiting_reqs)
            assigned = w.num_assigned_tokens
            if pending:
                assigned -= min(pending.get(w.worker_id, 0), assigned)
            if plans and (plan := plans.get(w.worker_id)) is not None:
                cost = plan.cost_tokens + assigned + per_request * queued
            else:
                cost = total - matched.get(w.worker_id, 0) + assigned + per_request * queued
            if toward is not None:
                cost += path_tokens(w, toward, total - matched.get(toward.worker_id, 0))
            if (best is None or cost < best_cost or (cost == best_cost and (
                    queued < best_queued or (queued == best_queued
                                             and (i - cursor) % n < (best - cursor) % n)))):
                best, best_cost, best_queued = i, cost, queued
        return best


def path_tokens(prefill: WorkerState, decode: WorkerState, num_tokens: int) -> int:
    """Moving ``num_tokens`` tokens' KV from ``prefill`` to ``decode``, in the prompt tokens
    ``prefill`` computes in that time (0: a path or a compute cost not measured, or
    workers that cannot pair)."""
    per_token_s = prefill.load.compute_s_per_token
    if not per_token_s or not _compatible(prefill, decode):
        return 0
    seconds = transfer_s(prefill, decode, num_tokens)
    return 0 if seconds is None else round(seconds / per_token_s)


def _queued(w: WorkerState) -> int:
    """Requests queued or running on the worker: this router's own count, or the
    engine's (which also sees other routers' requests), whichever is larger."""
    return max(w.num_assigned, w.load.num_running_reqs + w.load.num_waiting_reqs)


def _least_loaded(workers: Sequence[WorkerState], candidates: list[int], cursor: int) -> int:
    n = len(workers)
    return min(candidates, key=lambda i: (_load(workers[i]), (i - cursor) % n))


PLACEMENTS: dict[str, type[Placement]] = {
    "round_robin": RoundRobinPlacement,
    "least_loaded": LeastLoadedPlacement,
    "cache_aware": CacheAwarePlacement,
}
DEFAULT_PLACEMENT = "cache_aware"


def create_placement(name: str, link_aware: bool = True) -> Placement:
    """The placement ``name``; ``link_aware`` (``--link-aware``) for ``cache_aware``."""
    if name == CacheAwarePlacement.name:
        return CacheAwarePlacement(CacheAwareConfig(link_aware=link_aware))
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown placement {name!r}; valid placements: {', '.join(sorted(PLACEMENTS))}"
        ) from None
