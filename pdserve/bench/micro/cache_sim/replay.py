"""The replay: each request, in order, looks up the longest run of its leading blocks
the tier holds (those are its hit blocks), then saves all its blocks, as a tier does
after computing them: held ones are accesses, the others take slots the policy
frees. The tier is a real ``TierIndex`` with ``capacity`` slots and the policy the
registry makes (``belady``: the optimum; ``infinite``: every block kept), on a clock
that is the trace's time."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from pdserve.bench.micro.cache_sim.belady import BeladyPolicy
from pdserve.bench.micro.cache_sim.trace import Trace
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.policies.lru import LruPolicy
from pdserve.kv_transfer.tiers.policies.registry import make_policy
from pdserve.kv_transfer.tiers.policy import TierPolicy

SIM_ONLY = ("belady", "infinite")


@dataclass(frozen=True)
class SimResult:
    trace: str
    policy: str
    policy_class: str  # the class that was replayed (the registry's own)
    capacity_blocks: int
    hit_ratio: float
    num_hit_blocks: int
    num_block_refs: int
    num_requests: int
    num_evictions: int
    seconds: float  # the replay's wall time: the index's and the policy's work
    ns_per_block_ref: int  # ``seconds`` per block reference

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _policy(spec: str, capacity: int, trace: Trace) -> TierPolicy:
    if spec == "belady":
        return BeladyPolicy(trace.blocks)
    if spec == "infinite":
        return LruPolicy()
    return make_policy(spec, capacity)


def replay(trace: Trace, spec: str, capacity: int) -> SimResult:
    """``trace`` through a tier of ``capacity`` blocks under policy ``spec``."""
    if spec == "infinite":
        capacity = max(trace.num_distinct_blocks, 1)
    policy = _policy(spec, capacity, trace)
    clock = _Clock()
    index = TierIndex(capacity, policy, clock)
    belady = policy if isinstance(policy, BeladyPolicy) else None
    hits = 0
    start = time.perf_counter()
    for r, (t, blocks) in enumerate(zip(trace.times_s, trace.blocks, strict=True)):
        clock.now = t
        if belady is not None:
            belady.at_request(r)
        hits += len(index.match(blocks))
        index.commit([slot for _, slot in index.reserve(blocks)])
        index.take_gone()
    seconds = time.perf_counter() - start
    refs = trace.num_block_refs
    return SimResult(trace.name, spec, f"{type(policy).__module__}.{type(policy).__qualname__}",
                     capacity, hits / refs if refs else 0.0, hits, refs, len(trace.blocks),
                     index.num_evictions, round(seconds, 3),
                     round(seconds * 1e9 / refs) if refs else 0)
