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
from typing import TYPE_CHECKING

from pdserve.kv_transfer.metadata import NO_COPY, PdserveConnectorMetadata, TierCopy
from pdserve.kv_transfer.tier_index import TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

TIERS = ("host", "disk")


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

    def index(self, tier: str) -> TierIndex | None:
        return self._index.get(tier)

    def loads(self, request_id: str) -> bool:
        return request_id in self._loading

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
        if not found:
            return 0
        match = TierMatch(tuple(found))
        self._pin(match)
        self._matched[request.request_id] = match
        return len(found) * self._bs

    def unmatch(self, request_id: str) -> None:
        match = self._matched.pop(request_id, None)
        if match is not None:
            self._unpin(match)

    def plan_load(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int,
                  meta: PdserveConnectorMetadata) -> None:
        match = self._matched.pop(request.request_id, None)
        if match is None:
            return
        num = num_external_tokens // self._bs
        dst = tuple(blocks.get_unhashed_block_ids()[:num])
        if num == 0 or len(dst) != num or num > len(match.blocks):
            self._unpin(match)
            if num:
                raise RuntimeError(f"request {request.request_id}: cannot map {num} tier "
                                   f"blocks ({len(dst)} allocated)")
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
        num = min(request.num_computed_tokens // self._bs, len(request.block_hashes),
                  len(block_ids))
        hashes = request.block_hashes[:num]
        copies = {}
        for tier, index in self._index.items():
            reserved = index.reserve(hashes)
            if reserved:
                copies[tier] = TierCopy(tuple(block_ids[i] for i, _ in reserved),
                                        tuple(slot for _, slot in reserved),
                                        tuple(hashes[i] for i, _ in reserved))
        if not copies:
            return False
        self._saving[request.request_id] = copies
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
        for req_id in output.finished_sending or ():
            for tier, copy in self._saving.pop(req_id, {}).items():
                self._index[tier].commit(copy.slots)

    def _pin(self, match: TierMatch) -> None:
        for tier, index in self._index.items():
            index.pin(match.slots(tier))

    def _unpin(self, match: TierMatch) -> None:
        for tier, index in self._index.items():
            index.unpin(match.slots(tier))
