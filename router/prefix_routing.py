"""What the dispatcher asks of the prefix index: a ``PlacementRequest`` for a
prompt (its block hashes matched against every worker), and the hit metrics."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge

from pdserve.block_hash import chain_hashes

from .placement import PlacementRequest
from .prefix_index import PrefixIndex
from .worker_state import WorkerState


class PrefixMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(
            "pdserve_placement_prompt_tokens", "Prompt tokens of requests placed on a "
            "prefill worker.", registry=registry)
        self.matched_tokens = Counter(
            "pdserve_placement_matched_tokens", "Prompt tokens the prefix index said the "
            "chosen prefill worker held.", registry=registry)
        self.cached_tokens = Counter(
            "pdserve_placement_cached_tokens", "Prompt tokens the chosen prefill engine "
            "reported served from its prefix cache.", registry=registry)
        self.hit_ratio = Gauge(
            "pdserve_placement_prefix_hit_ratio", "Prefix cache hit ratio of prefills "
            "(engine-reported cached / prompt tokens, since start).", registry=registry)
        self.predicted_ratio = Gauge(
            "pdserve_placement_index_hit_ratio", "Prefix-index predicted hit ratio of "
            "prefills (matched / prompt tokens, since start).", registry=registry)
        self.placed = Counter(
            "pdserve_placement_prefill_requests", "Prefills placed, by worker id.",
            ["worker"], registry=registry)
        self.indexed_blocks = Gauge(
            "pdserve_placement_indexed_blocks", "(worker, block) entries in the prefix index.",
            registry=registry)


class PrefixRouting:
    def __init__(self, index: PrefixIndex, registry: CollectorRegistry) -> None:
        self.index = index
        self.metrics = PrefixMetrics(registry)
        # Totals since start, for the ratio gauges.
        self.num_prompt_tokens = self.num_matched_tokens = self.num_cached_tokens = 0

    def request(self, prompt_token_ids: Sequence[int]) -> PlacementRequest:
        """The prompt matched against every indexed worker, in tokens."""
        matched: dict[str, int] = {}
        for block_size in self.index.block_sizes():
            hashes = chain_hashes(prompt_token_ids, block_size)
            for worker_id, blocks in self.index.match(hashes).items():
                if self.index.block_size(worker_id) == block_size:
                    matched[worker_id] = blocks * block_size
        return PlacementRequest(len(prompt_token_ids), matched)

    def on_placed(self, request: PlacementRequest, worker: WorkerState) -> None:
        """A prefill was placed on ``worker``."""
        m = self.metrics
        matched = request.matched_tokens.get(worker.worker_id, 0)
        self.num_prompt_tokens += request.num_prompt_tokens
        self.num_matched_tokens += matched
        m.prompt_tokens.inc(request.num_prompt_tokens)
        m.matched_tokens.inc(matched)
        m.placed.labels(worker.worker_id or worker.endpoint).inc()
        m.predicted_ratio.set(self.num_matched_tokens / max(self.num_prompt_tokens, 1))
        m.indexed_blocks.set(self.index.num_blocks)

    def on_prefilled(self, num_cached_tokens: int) -> None:
        """The placed prefill finished; its engine served ``num_cached_tokens`` from cache."""
        self.num_cached_tokens += num_cached_tokens
        self.metrics.cached_tokens.inc(num_cached_tokens)
        self.metrics.hit_ratio.set(self.num_cached_tokens / max(self.num_prompt_tokens, 1))
