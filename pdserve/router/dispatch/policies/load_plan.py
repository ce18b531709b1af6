"""How each prefill worker would get a prompt's tokens (``LoadPlan``), and what that
costs: its engine's prefix cache, then its KV tiers, then the cluster KV store, then a
peer's host tier over the KV transport (the cluster KV pool), the rest computed.

This follows the worker's connector, which loads engine-cache hits (free), then the
blocks its own tiers hold (host, then disk), then those the cluster KV store holds
(announced by any worker on the same store: ``prefix/store_match.py``), then the
blocks in [that point, ``pool_source.num_blocks``) from the peer's host tier (a peer of
the same compatibility hash and ``--kv-compression``: another encoding is refused), and
never the prompt's last token:
tier and pool matches count at most ``loadable_tokens``. A worker's tier run is the
longer of its host and its disk match (the prefix index matches each tier's chain on
its own, so a run alternating tiers block by block counts short: the estimate errs
toward computing). Tokens cost their source's ratio (``tier_cost``: loading one token
over computing it, measured per worker), computed ones 1; the pool is used only where
its ratio is below 1, from the peer whose host tier holds the longest run; so is the
store.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from pdserve.core.handle import PoolSource
from pdserve.router.dispatch.policies.tier_cost import TierRatios, tier_ratios
from pdserve.router.dispatch.workers.state import WorkerState

_NO_TIERS: Mapping[str, int] = {}


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One prefill worker's way to the prompt: the tokens it would load from each source
    beyond its engine's cache, and the prompt's cost there in computed-token
    equivalents (computed tokens + loaded ones at their ratio)."""

    num_host_tokens: int
    num_disk_tokens: int
    num_pool_tokens: int
    cost_tokens: int
    pool_source: PoolSource | None = None  # set where num_pool_tokens > 0
    num_store_tokens: int = 0  # from the cluster KV store, after the disk tier


def loadable_tokens(num_prompt_tokens: int, block_size: int) -> int:
    """The most prompt tokens a connector loads: whole blocks, never the last token."""
    return max(num_prompt_tokens - 1, 0) // block_size * block_size


def plan_load(num_prompt_tokens: int, engine: int, host: int, disk: int, pool: int,
              ratios: TierRatios, store: int = 0) -> LoadPlan:
    """The plan of a worker whose engine holds ``engine`` leading tokens, its host and
    disk tiers ``host`` and ``disk``, the cluster KV store ``store`` and the best peer's
    host tier ``pool`` (each counted from the prompt's start; tiers, store and pool
    already capped at the loadable)."""
    after_host = max(engine, host)
    after_disk = max(after_host, disk)
    after_store = max(after_disk, store) if ratios.store < 1.0 else after_disk
    after_pool = max(after_store, pool) if ratios.pool < 1.0 else after_store
    cost = ((after_host - engine) * ratios.host + (after_disk - after_host) * ratios.disk
            + (after_store - after_disk) * ratios.store
            + (after_pool - after_store) * ratios.pool + num_prompt_tokens - after_pool)
    return LoadPlan(after_host - engine, after_disk - after_host, after_pool - after_store,
                    round(cost), num_store_tokens=after_store - after_disk)


def plan_loads(num_prompt_tokens: int, matched: Mapping[str, int],
               tier_tokens: Mapping[str, Mapping[str, int]], prefill: Sequence[WorkerState],
               block_size_of: Callable[[str], int | None], pool: bool = True
               ) -> dict[str, LoadPlan]:
    """Per healthy worker of ``prefill`` that would load any token beyond its engine match
    (``matched``) from its tiers or the pool, its plan (workers without one compute what
    their engine lacks). ``tier_tokens``: per worker id, the loadable tokens each of its
    tiers holds (``store``: the cluster KV store it loads from); pool peers are the other
    healthy, compatible workers with a KV port (none without ``pool``)."""
    holders = _pool_holders(prefill, tier_tokens) if pool else {}
    plans: dict[str, LoadPlan] = {}
    for w in prefill:
        worker_id = w.worker_id
        if not (w.healthy and worker_id):
            continue
        own = tier_tokens.get(worker_id, _NO_TIERS)
        host, disk, store = own.get("host", 0), own.get("disk", 0), own.get("store", 0)
        peer_tokens, peer = _best_peer(holders.get(_pool_key(w), ()), worker_id)
        engine = matched.get(worker_id, 0)
        if max(host, disk, store, peer_tokens) <= engine:
            continue
        block_size = block_size_of(worker_id) or (block_size_of(peer.worker_id) if peer
                                                  else None)
        if not block_size:
            continue
        load = w.load
        plan = plan_load(num_prompt_tokens, engine, host, disk, peer_tokens,
                         tier_ratios(load.kv_load, load.compute_s_per_token, block_size),
                         store)
        if plan.num_pool_tokens and peer is not None:
            plan = replace(plan, pool_source=PoolSource(
                peer.kv_host, peer.kv_port, peer_tokens // block_size, peer.worker_id))
        plans[worker_id] = plan
    return plans


def _pool_key(w: WorkerState) -> tuple[str, str]:
    """What two workers must share to pull each other's host-tier blocks: their KV
    (compatibility hash) and the pool's encoding (a peer refuses another)."""
    return w.compatibility_hash, w.kv_compression


def _pool_holders(prefill: Sequence[WorkerState], tier_tokens: Mapping[str, Mapping[str, int]]
                  ) -> dict[tuple[str, str], list[tuple[int, WorkerState]]]:
    """Per pool key (``_pool_key``), the healthy workers able to serve a pool pull (a KV
    port) whose host tier holds some of the prompt, longest run first (ties: list
    order)."""
    holders: dict[tuple[str, str], list[tuple[int, WorkerState]]] = {}
    for w in prefill:
        tokens = tier_tokens.get(w.worker_id, _NO_TIERS).get("host", 0)
        if tokens and w.healthy and w.kv_port:
            holders.setdefault(_pool_key(w), []).append((tokens, w))
    for group in holders.values():
        group.sort(key=lambda held: -held[0])
    return holders


def _best_peer(holders: Sequence[tuple[int, WorkerState]], worker_id: str
               ) -> tuple[int, WorkerState | None]:
    for tokens, peer in holders[:2]:  # the longest run not the worker's own
        if peer.worker_id != worker_id:
            return tokens, peer
    return 0, None
