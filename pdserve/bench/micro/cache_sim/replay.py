"""The replay: each request, in order, looks up the longest run of its leading blocks
the tier holds (those are its hit blocks), then saves all its blocks, as a tier does
after computing them: held ones are accesses, the others take slots the policy
frees. The tier is a real ``TierIndex`` with ``capacity`` slots and the policy the
registry makes (``belady``: the optimum; ``infinite``: every block kept), on a clock
that is the trace's time.

``admission`` (``--admission``, a ``--kv-store-admission`` name) stands in front of the
tier as it does in front of the cluster KV store: the policy the store would make for
that many blocks is asked ``admit`` for each block of a request the tier does not hold,
told of each hit (``record_access``), and the request saves only its blocks before the
first it refused (the store writes only a prefix: a block after a hole is never loaded).
So ``--policy lru --admission doorkeeper`` is a store whose server evicts LRU
(``allkeys-lru``) with the doorkeeper deciding what is written."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from pdserve.bench.micro.cache_sim.belady import BeladyPolicy
from pdserve.bench.micro.cache_sim.trace import Trace
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.policies.admission import admitted_run
from pdserve.kv_transfer.tiers.policies.lru import LruPolicy
from pdserve.kv_transfer.tiers.policies.registry import ADMIT_ALL, make_admission, make_policy
from pdserve.kv_transfer.tiers.policy import TierPolicy

SIM_ONLY = ("belady", "infinite")


@dataclass(frozen=True)
class SimResult:
    trace: str
    policy: str
    policy_class: str  # the class that was replayed (the registry's own)
    admission: str  # the store's admission in front of it (``all``: none)
    capacity_blocks: int
    hit_ratio: float
    num_hit_blocks: int
    num_block_refs: int
    num_requests: int
    num_evictions: int
    num_saved_blocks: int  # blocks written to the tier (a store's writes)
    num_not_admitted: int  # blocks not saved: refused, or after a refused one
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


def _admitted(gate: TierPolicy | None, index: TierIndex, blocks: Sequence[bytes],
              num_hit: int, now: float) -> int:
    """How many of ``blocks`` the request saves: all without a gate; else up to the
    first block not held that ``gate`` refuses (every block not held is asked)."""
    if gate is None:
        return len(blocks)
    for key in blocks[:num_hit]:
        gate.record_access(key, now)
    asked = [i for i in range(num_hit, len(blocks)) if not index.holds(blocks[i])]
    run = admitted_run(gate, [blocks[i] for i in asked], now, None)
    return asked[run] if run < len(asked) else len(blocks)


def replay(trace: Trace, spec: str, capacity: int, admission: str = ADMIT_ALL) -> SimResult:
    """``trace`` through a tier of ``capacity`` blocks under policy ``spec``, behind the
    store's ``admission``."""
    if spec == "infinite":
        capacity = max(trace.num_distinct_blocks, 1)
    policy = _policy(spec, capacity, trace)
    gate = make_admission(admission, capacity)
    clock = _Clock()
    index = TierIndex(capacity, policy, clock)
    belady = policy if isinstance(policy, BeladyPolicy) else None
    hits = refused = saved = 0
    start = time.perf_counter()
    for r, (t, blocks) in enumerate(zip(trace.times_s, trace.blocks, strict=True)):
        clock.now = t
        if belady is not None:
            belady.at_request(r)
        num_hit = len(index.match(blocks))
        hits += num_hit
        cut = _admitted(gate, index, blocks, num_hit, t)
        refused += len(blocks) - cut
        slots = [slot for _, slot in index.reserve(blocks[:cut])]
        saved += len(slots)
        index.commit(slots)
        index.take_gone()
    seconds = time.perf_counter() - start
    refs = trace.num_block_refs
    return SimResult(trace.name, spec, f"{type(policy).__module__}.{type(policy).__qualname__}",
                     admission, capacity, hits / refs if refs else 0.0, hits, refs,
                     len(trace.blocks), index.num_evictions, saved, refused, round(seconds, 3),
                     round(seconds * 1e9 / refs) if refs else 0)
