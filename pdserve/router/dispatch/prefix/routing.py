"""What the dispatcher asks of the prefix index: a ``PlacementRequest`` for a
prompt (its block hashes matched against every worker's engine cache and KV tiers and
the cluster KV store (``store_match.py``), and each worker's plan to load from its
tiers, the store or a peer's: ``load_plan.py``), the hit
metrics, and the pending blocks of prefills in flight (recorded at placement, released
when the prefill fails)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from pdserve.core.block_hash import chain_hashes, salt_root, tier_hashes
from pdserve.router.dispatch.policies.load_plan import loadable_tokens, plan_loads
from pdserve.router.dispatch.policies.placement import PlacementRequest
from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.prefix.store_match import StoreGroups, store_groups, store_runs
from pdserve.router.dispatch.workers.state import WorkerState
from pdserve.router.metrics import PREFIX, counter, gauge

# A worker's own KV tiers (the store's blocks are every store worker's: ``store_match``).
OWN_TIERS = ("host", "disk")
# The ``tier`` labels of ``pdserve:placement_tier_tokens``.
TIER_SOURCES = ("host", "disk", "pool", "store")


class PrefixMetrics:
    def __init__(self, registry: CollectorRegistry | None) -> None:
        r = registry
        self.prompt_tokens = counter(r, f"{PREFIX}placement_prompt_tokens", "Prompt tokens of "
                                     "requests placed on a prefill worker.")
        self.matched_tokens = counter(r, f"{PREFIX}placement_matched_tokens", "Prompt tokens "
                                      "the prefix index said the chosen prefill worker held.")
        self.cached_tokens = counter(r, f"{PREFIX}placement_cached_tokens", "Prompt tokens the "
                                     "chosen prefill engine reported served from its prefix "
                                     "cache.")
        self.hit_ratio = gauge(r, f"{PREFIX}prefix_cache_hit_ratio", "Prefix cache hit ratio "
                               "of prefills (engine-reported cached / prompt tokens, since "
                               "start).")
        self.predicted_ratio = gauge(r, f"{PREFIX}prefix_index_hit_ratio", "Prefix-index "
                                     "predicted hit ratio of prefills (matched / prompt tokens, "
                                     "since start).")
        self.indexed_blocks = gauge(r, f"{PREFIX}prefix_index_blocks", "(worker, block) "
                                    "entries in the prefix index.")
        self.pending_blocks = gauge(r, f"{PREFIX}prefix_pending_blocks", "(worker, block) "
                                    "entries pending in the prefix index: placed prefills "
                                    "computing them, no KV event yet.")
        self.tier_tokens = counter(r, f"{PREFIX}placement_tier_tokens", "Prompt tokens the "
                                   "chosen prefill worker was expected to load from its KV "
                                   "tiers (host, disk), a peer's host tier (pool) or the "
                                   "cluster KV store (store).",
                                   ["tier"])
        self.tier_children = tuple(self.tier_tokens.labels(t) for t in TIER_SOURCES)
        self.decode_prompt_tokens = counter(r, f"{PREFIX}placement_decode_prompt_tokens",
                                            "Prompt tokens of requests placed on a decode "
                                            "worker.")
        self.decode_matched_tokens = counter(r, f"{PREFIX}placement_decode_matched_tokens",
                                             "Prompt tokens the prefix index said the chosen "
                                             "decode worker held (a conversation's earlier "
                                             "turns: not computed, not loaded).")
        self.pending_expired = counter(r, f"{PREFIX}prefix_pending_expired", "Pending (worker, "
                                       "block) entries that no KV event confirmed in time, or "
                                       "evicted over the cap.")


@dataclass(frozen=True)
class PendingPrefix:
    """The blocks one placed prefill made pending on its worker (to release on failure)."""

    worker_id: str
    block_hashes: tuple[int, ...]


class PrefixRouting:
    def __init__(self, index: PrefixIndex, registry: CollectorRegistry | None,
                 pool: bool = True) -> None:
        self.index = index
        self.pool = pool  # False: no plan pulls from a peer's host tier (``--kv-pool off``)
        self.metrics = PrefixMetrics(registry)
        # Totals since start, for the ratio gauges.
        self.num_prompt_tokens = self.num_matched_tokens = self.num_cached_tokens = 0
        self._num_expired = 0  # pending entries expired or evicted, as last exported

    def request(self, prompt_token_ids: Sequence[int], prefill: Sequence[WorkerState] = (),
                cache_salt: str | None = None, others: Sequence[WorkerState] = ()
                ) -> PlacementRequest:
        """The prompt matched against every indexed worker's engine cache (blocks a
        prefill in flight there is computing count as held), KV tiers and cluster KV
        store, in tokens; and the load plans of the workers of ``prefill`` (the
        snapshots placement reads) that would load from a tier, the store or a peer's
        host tier (none without ``prefill``). ``others`` (decode workers): whose store
        announcements count too. Under ``cache_salt`` the prompt's blocks have names of
        their own: it matches only blocks computed under the same salt."""
        root = salt_root(cache_salt)
        num_tokens = len(prompt_token_ids)
        matched: dict[str, int] = {}
        pending: dict[str, int] = {}
        hashed: dict[int, Sequence[int]] = {}
        tiers: dict[str, dict[str, int]] = {}
        groups = store_groups((*prefill, *others))
        store_sizes: dict[str, int] = {}  # a store worker's block size (it may index none)
        for block_size in self.index.block_sizes():
            hashes = hashed[block_size] = chain_hashes(prompt_token_ids, block_size, root)
            found = self.index.match_blocks(hashes)
            for worker_id, blocks in found.num_blocks.items():
                if self.index.block_size(worker_id) == block_size:
                    matched[worker_id] = blocks * block_size
                    if worker_id in found.num_pending:
                        pending[worker_id] = found.num_pending[worker_id] * block_size
            num_loadable = loadable_tokens(num_tokens, block_size) // block_size
            for tier in OWN_TIERS:
                for worker_id, blocks in self._match_tier(hashes, num_loadable, tier).items():
                    if self.index.block_size(worker_id) == block_size:
                        tiers.setdefault(worker_id, {})[tier] = blocks * block_size
            for worker_id, blocks in self._match_store(hashes, num_loadable, groups,
                                                       block_size).items():
                tiers.setdefault(worker_id, {})["store"] = blocks * block_size
                store_sizes[worker_id] = block_size
        if not tiers:
            return PlacementRequest(num_tokens, matched, pending, hashed)

        def block_size_of(worker_id: str) -> int | None:
            return self.index.block_size(worker_id) or store_sizes.get(worker_id)

        plans = plan_loads(num_tokens, matched, tiers, prefill, block_size_of, pool=self.pool)
        return PlacementRequest(num_tokens, matched, pending, hashed, tiers, plans)

    def _match_store(self, hashes: Sequence[int], num_blocks: int, groups: StoreGroups,
                     block_size: int) -> dict[str, int]:
        """Per worker on a store, the leading blocks of ``hashes[:num_blocks]`` that
        store holds as announced by its workers of ``block_size``-token blocks."""
        if not (num_blocks and groups.ttl_s):
            return {}
        in_store = tier_hashes(hashes[:num_blocks], "store")
        if not self.index.is_held(in_store[0]):
            return {}
        sized = StoreGroups({w: g for w, g in groups.group_of.items()
                             if self.index.block_size(w) in (block_size, None)},
                            groups.ttl_s)
        runs = store_runs(self.index, in_store, sized)
        return {w: runs[g] for w, g in sized.group_of.items() if g in runs}

    def _match_tier(self, hashes: Sequence[int], num_blocks: int, tier: str
                    ) -> dict[str, int]:
        """Leading blocks of ``hashes[:num_blocks]`` each worker's ``tier`` holds; one
        lookup when no worker's tier holds the first (no tiers, or a new prefix)."""
        if not num_blocks or not self.index.is_held(tier_hashes(hashes[:1], tier)[0]):
            return {}
        return self.index.match_held(tier_hashes(hashes[:num_blocks], tier))

    def on_placed(self, request: PlacementRequest, worker: WorkerState) -> PendingPrefix | None:
        """A prefill was placed on ``worker``: its prompt's blocks are pending there
        (returned, for ``on_prefill_failed``; None where the worker is not indexed)."""
        placed = self._record_pending(request, worker)
        m = self.metrics
        matched = request.matched_tokens.get(worker.worker_id, 0)
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_matched_tokens += matched
        m.prompt_tokens.inc(request.num_prompt_tokens)
        m.matched_tokens.inc(matched)
        plan = request.load_plans.get(worker.worker_id) if request.load_plans else None
        if plan is not None:
            host, disk, pool, store = m.tier_children
            host.inc(plan.num_host_tokens)
            disk.inc(plan.num_disk_tokens)
            pool.inc(plan.num_pool_tokens)
            store.inc(plan.num_store_tokens)
        m.predicted_ratio.set(self.num_matched_tokens / max(self.num_prompt_tokens, 1))
        m.indexed_blocks.set(self.index.num_blocks)
        self._export_pending()
        return placed

    def on_decode_placed(self, num_prompt_tokens: int, decode_cached_tokens: int) -> None:
        """A request was placed on a decode worker whose cache holds that many of its
        prompt tokens."""
        self.metrics.decode_prompt_tokens.inc(num_prompt_tokens)
        self.metrics.decode_matched_tokens.inc(decode_cached_tokens)

    def on_prefill_failed(self, pending: PendingPrefix | None) -> None:
        """The placed prefill failed or was aborted: it will not compute its blocks."""
        if pending is not None:
            self.index.release_pending(pending.worker_id, pending.block_hashes)
            self._export_pending()

    def _record_pending(self, request: PlacementRequest, worker: WorkerState
                        ) -> PendingPrefix | None:
        block_size = self.index.block_size(worker.worker_id) if worker.worker_id else None
        hashes = request.block_hashes.get(block_size or 0)
        if not hashes:
            return None
        return PendingPrefix(worker.worker_id, self.index.add_pending(worker.worker_id, hashes))

    def _export_pending(self) -> None:
        pending = self.index.pending
        num_expired = pending.num_expired + pending.num_evicted
        if num_expired != self._num_expired:
            self.metrics.pending_expired.inc(num_expired - self._num_expired)
            self._num_expired = num_expired
        self.metrics.pending_blocks.set(len(pending))

    def on_prefilled(self, num_cached_tokens: int) -> None:
        """The placed prefill finished; its engine served ``num_cached_tokens`` from cache."""
        self.num_cached_tokens += num_cached_tokens
        self.metrics.cached_tokens.inc(num_cached_tokens)
        self.metrics.hit_ratio.set(self.num_cached_tokens / max(self.num_prompt_tokens, 1))
