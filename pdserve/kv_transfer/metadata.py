"""Typed messages between the connector's scheduler side and its worker side."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from pdserve.core.handle import KVHandle, PushTarget
from pdserve.kv_transfer.push.spec import PushSpec
from pdserve.kv_transfer.remote.names import BlockName

__all__ = ["KVHandle", "LeaseSpec", "LoadSpec", "PdserveConnectorMetadata", "PushSpec",
           "PushTarget", "PoolLoad", "StoreCopy", "StoreFeedback", "TierCopy", "NO_COPY"]


@dataclass(frozen=True)
class LeaseSpec:
    """Prefill: keep these blocks for a decode until ``deadline`` (time.time())."""

    block_ids: tuple[int, ...]
    deadline: float


@dataclass(frozen=True)
class LoadSpec:
    """Decode: pull ``src_block_ids`` of ``handle`` into our ``dst_block_ids``.

    ``first_position`` is the index of ``src_block_ids[0]`` in the handle's
    block list (blocks before it were local prefix-cache hits): pushed blocks
    are addressed by position, not by the prefill's block ids.
    """

    handle: KVHandle
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    first_position: int = 0


@dataclass(frozen=True)
class TierCopy:
    """Host tier: copy between the cache's ``block_ids`` and the tier's ``slots``
    (a save: cache → tier; a load: tier → cache); ``hashes`` name the blocks."""

    block_ids: tuple[int, ...]
    slots: tuple[int, ...]
    hashes: tuple[bytes, ...]


NO_COPY = TierCopy((), (), ())


@dataclass(frozen=True)
class PoolLoad:
    """The cluster KV pool: pull the blocks named ``hashes`` from the host tier of the
    peer whose KV endpoint is ``host:port`` into our ``block_ids``."""

    host: str
    port: int
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class StoreCopy:
    """The cluster KV store: the blocks named ``names`` go between the store and the
    cache's ``block_ids`` (a load: store → cache; a save: cache → store, behind the
    request)."""

    block_ids: tuple[int, ...]
    names: tuple[BlockName, ...]


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the worker side; rebuilt every step."""

    leases: dict[str, LeaseSpec] = field(default_factory=dict)
    loads: dict[str, LoadSpec] = field(default_factory=dict)
    releases: list[KVHandle] = field(default_factory=list)
    pushes: dict[str, PushSpec] = field(default_factory=dict)
    # Pushed transfers no decode will take (the prefill stopped at its first token).
    push_cancels: list[PushTarget] = field(default_factory=list)
    # Host tier: a finished request's blocks saved (its blocks are held until done),
    # a new request's blocks loaded (it waits, as for a remote load).
    # The disk tier's part of the same requests (an empty copy where it has none).
    tier_saves: dict[str, TierCopy] = field(default_factory=dict)
    tier_loads: dict[str, TierCopy] = field(default_factory=dict)
    disk_saves: dict[str, TierCopy] = field(default_factory=dict)
    disk_loads: dict[str, TierCopy] = field(default_factory=dict)
    # A new request's blocks pulled from a peer's host tier (after any tier load).
    pool_loads: dict[str, PoolLoad] = field(default_factory=dict)
    # The cluster KV store: blocks loaded from it (after the tiers' and the pool's),
    # and a finished request's blocks copied out and published to it.
    store_loads: dict[str, StoreCopy] = field(default_factory=dict)
    store_saves: dict[str, StoreCopy] = field(default_factory=dict)
    # The scheduler side's tier counters since the last step (misses, evictions).
    tier_counts: dict[str, int] = field(default_factory=dict)
    # Nothing is scheduled this step: the engine only steps to learn about transfers.
    idle: bool = False
    # What this step computes (for the step-time fit): sequences decoding one token,
    # and prompt tokens computed.
    num_decode_seqs: int = 0
    num_prefill_tokens: int = 0


@dataclass
class StoreFeedback(KVConnectorWorkerMetadata):
    """Worker side → scheduler side, with a step's output: what the fetch-or-compute
    decision learns (``remote.decision``): the engine's prefill time per prompt token
    (the step model's fit, 0: not yet known), the store loads that ended (bytes,
    nanoseconds; the bytes are the blocks' in the cache, whatever their encoding in the
    store), the blocks the writer published and those whose publication failed; and,
    once, that the worker side turned the store off (``store_off``: its attention layers
    are not those the blocks' names say), so the scheduler side stops looking up and
    publishing."""

    per_token_ns: int = 0
    loads: list[tuple[int, int]] = field(default_factory=list)
    unpublished: list[str] = field(default_factory=list)  # keys a write failed to publish
    published: list[tuple[str, int]] = field(default_factory=list)  # (key, pdserve hash)
    store_off: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StoreFeedback):
            self.per_token_ns = max(self.per_token_ns, other.per_token_ns)
            self.loads.extend(other.loads)
            self.unpublished.extend(other.unpublished)
            self.published.extend(other.published)
            self.store_off = self.store_off or other.store_off
        return self
