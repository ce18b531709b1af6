"""The KV tiers' plan, on the connector's scheduler side: which of a new request's
blocks load from the host or the disk tier, which of a finished request's blocks are
saved to them, and what the worker side's reports change.

A block is looked for in the engine's cache first (vLLM), then the host tier, then
the disk tier; a prompt loads the longest run of blocks found in either, never its
last token. A finished request's computed full blocks are written through to every
tier that does not hold them (host memory, then disk), on the worker's threads,
while vLLM keeps the blocks allocated. Slots a load reads are pinned until the load
is reported; a failed load's slots are forgotten (their bytes were bad); a save's
slots become matchable once it is reported done.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.core.block_hash import KV_TIERS, chain_hashes, salt_root, tier_hashes
from pdserve.kv_transfer.metadata import NO_COPY, PdserveConnectorMetadata, TierCopy
from pdserve.kv_transfer.tiers.index import TierIndex

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

TIERS = ("host", "disk")
# The ``medium`` of the KV events that announce a tier's blocks (``vllm_kv_events``),
# the cluster KV store's (``pdserve:store``: blocks this worker published) included.
EVENT_MEDIUM = {tier: f"pdserve:{tier}" for tier in KV_TIERS}


@dataclass(frozen=True)
class TierMatch:
    """A request's blocks found in the tiers, in prompt order: ``(tier, slot, hash)``."""

    blocks: tuple[tuple[str, int, bytes], ...]

    def split(self, block_ids: tuple[int, ...]) -> dict[str, TierCopy]:
        """The copies per tier that put these blocks into ``block_ids``."""
        out = {}
        for tier in TIERS:
            picked = [(b, slot, h) for b, (t, slot, h) in zip(block_ids, self.blocks,
                                                              strict=False) if t == tier]
            if picked:
                ids, slots, hashes = zip(*picked, strict=True)
                out[tier] = TierCopy(tuple(ids), tuple(slots), tuple(hashes))
        return out

    def slots(self, tier: str) -> list[int]:
        return [slot for t, slot, _ in self.blocks if t == tier]


class TierPlanner:
    def __init__(self, block_size: int, host: TierIndex | None,
                 disk: TierIndex | None) -> None:
        self._bs = block_size
        self._index = {name: index for name, index in (("host", host), ("disk", disk))
                       if index is not None}
        self._matched: dict[str, TierMatch] = {}  # found, blocks not allocated yet
        self._loading: dict[str, TierMatch] = {}
        self._saving: dict[str, dict[str, TierCopy]] = {}
        # Residency for the router: each held block's pdserve hash (vLLM hash -> ours),
        # and the stores and removals not yet published, in order.
        self._names: dict[str, dict[bytes, int]] = {tier: {} for tier in self._index}
        self._saving_names: dict[str, dict[bytes, int]] = {}
        self._changes: list[tuple[str, bool, int]] = []  # (tier, stored?, pdserve hash)
        self._misses: dict[str, int] = {}  # per matched request: blocks no tier held
        self._evictions = dict.fromkeys(self._index, 0)  # as last reported
        self.num_miss_blocks = 0

    def index(self, tier: str) -> TierIndex | None:
        return self._index.get(tier)

    def tokens_by_tier(self, request_id: str) -> dict[str, int]:
        """The tokens a request loads from each tier (none: not loading from a tier)."""
        match = self._loading.get(request_id)
        if match is None:
            return {}
        return {t: n * self._bs for t in TIERS if (n := len(match.slots(t)))}

    def match(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens the tiers hold after the engine's own hits (0: none); pinned until
        loaded or dropped."""
        self.unmatch(request.request_id)  # asked again: the last match was not allocated
        if num_computed_tokens % self._bs:
            return 0
        start, end = num_computed_tokens // self._bs, (request.num_tokens - 1) // self._bs
        found = []
        for h in request.block_hashes[start:end]:
            hit = next(((t, s) for t, index in self._index.items()
                        if (s := index.lookup(h)) is not None), None)
            if hit is None:
                break
            found.append((hit[0], hit[1], h))
        self._misses[request.request_id] = max(end - start - len(found), 0)
        if not found:
            return 0
        match = TierMatch(tuple(found))
        self._pin(match)
        self._matched[request.request_id] = match
        return len(found) * self._bs

    def unmatch(self, request_id: str) -> None:
        self._misses.pop(request_id, None)
        match = self._matched.pop(request_id, None)
        if match is not None:
            self._unpin(match)

    def num_matched(self, request_id: str) -> int:
        """Blocks ``match`` found for the request (0: none, or already planned)."""
        match = self._matched.get(request_id)
        return 0 if match is None else len(match.blocks)

    def count_misses(self, request_id: str, num_loaded_elsewhere: int = 0) -> None:
        """The request was scheduled: count the blocks past the engine's hits that no
        tier held (less those a peer's tier supplies)."""
        self.num_miss_blocks += max(self._misses.pop(request_id, 0) - num_loaded_elsewhere, 0)

    def plan_load(self, request: Request, dst: tuple[int, ...],
                  meta: PdserveConnectorMetadata) -> None:
        """Load the first ``len(dst)`` matched blocks into ``dst`` (the rest unpinned)."""
        match = self._matched.pop(request.request_id, None)
        if match is None:
            return
        num = len(dst)
        if num == 0 or num > len(match.blocks):
            self._unpin(match)
            if num:
                raise RuntimeError(f"request {request.request_id}: cannot map {num} tier "
                                   f"blocks ({len(match.blocks)} matched)")
            return
        self._unpin(TierMatch(match.blocks[num:]))
        taken = TierMatch(match.blocks[:num])
        self._loading[request.request_id] = taken
        copies = taken.split(dst)
        meta.tier_loads[request.request_id] = copies.get("host", NO_COPY)
        meta.disk_loads[request.request_id] = copies.get("disk", NO_COPY)

    def plan_save(self, request: Request, block_ids: list[int],
                  meta: PdserveConnectorMetadata) -> bool:
        """Write a finished request's computed full blocks through to the tiers that do
        not hold them; True if there is a copy (its blocks then stay allocated)."""
        self.unmatch(request.request_id)
        self._misses.pop(request.request_id, None)
        num = min(request.num_computed_tokens // self._bs, len(request.block_hashes),
                  len(block_ids))
        hashes = request.block_hashes[:num]
        copies = {}
        for tier, index in self._index.items():
            reserved = index.reserve(hashes, request.cache_salt)
            self._drain(tier)
            if reserved:
                copies[tier] = TierCopy(tuple(block_ids[i] for i, _ in reserved),
                                        tuple(slot for _, slot in reserved),
                                        tuple(hashes[i] for i, _ in reserved))
        if not copies:
            return False
        self._saving[request.request_id] = copies
        self._saving_names[request.request_id] = dict(zip(
            hashes, chain_hashes(request.all_token_ids[:num * self._bs], self._bs,
                                 salt_root(request.cache_salt)),
            strict=False))
        meta.tier_saves[request.request_id] = copies.get("host", NO_COPY)
        meta.disk_saves[request.request_id] = copies.get("disk", NO_COPY)
        return True

    def update(self, output: KVConnectorOutput) -> None:
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            match = self._loading.pop(req_id, None)
            if match is not None:
                self._unpin(match)
                if req_id in failed:
                    for tier, index in self._index.items():
                        index.discard(match.slots(tier))
                        self._drain(tier)
        for req_id in output.finished_sending or ():
            saved = self._saving.pop(req_id, {})
            by_hash = self._saving_names.pop(req_id, {})
            for tier, copy in saved.items():
                self._index[tier].commit(copy.slots)
                for h in copy.hashes:
                    name = by_hash.get(h)
                    if name is not None and h not in self._names[tier]:
                        self._names[tier][h] = name
                        self._changes.append((tier, True, name))

    def drop_all(self) -> int:
        """Forget every block the tiers hold (a weight update: their KV is the old
        model's); the router hears of each removal. How many were dropped."""
        return sum(index.drop_held() for index in self._index.values())

    def take_changes(self) -> list[tuple[str, bool, list[int]]]:
        """The tiers' residency changes since the last call, in order, as runs of
        ``(tier, stored, block hashes in the tier's namespace)``: the KV events that
        tell the router which blocks each tier holds."""
        for tier in self._index:
            self._drain(tier)
        runs: list[tuple[str, bool, list[int]]] = []
        for tier, stored, name in self._changes:
            if runs and runs[-1][0] == tier and runs[-1][1] == stored:
                runs[-1][2].append(name)
            else:
                runs.append((tier, stored, [name]))
        self._changes = []
        return [(tier, stored, tier_hashes(names, tier)) for tier, stored, names in runs]

    def take_counts(self) -> dict[str, Any]:
        """Counters for the worker side since the last call: misses, evictions."""
        counts: dict[str, Any] = {}
        if self.num_miss_blocks:
            counts["tier_miss_blocks"], self.num_miss_blocks = self.num_miss_blocks, 0
        for tier, index in self._index.items():
            new = index.num_evictions - self._evictions[tier]
            if new:
                counts["tier_evictions" if tier == "host" else "disk_evictions"] = new
                self._evictions[tier] = index.num_evictions
        return counts

    def _drain(self, tier: str) -> None:
        names = self._names[tier]
        for h in self._index[tier].take_gone():
            name = names.pop(h, None)
            if name is not None:
                self._changes.append((tier, False, name))

    def _pin(self, match: TierMatch) -> None:
        for tier, index in self._index.items():
            index.pin(match.slots(tier))

    def _unpin(self, match: TierMatch) -> None:
        for tier, index in self._index.items():
            index.unpin(match.slots(tier))
