"""What the cluster KV store holds of a prompt, as the router knows it.

A worker that publishes blocks to the store (``--kv-store``) announces them in its KV
events under the ``store`` tier's namespace (``core.block_hash.tier_hashes``), so the
prefix index files them under that worker. But the store is shared: a block any
worker published is loadable by every worker on the same store. Workers say which
store they use in their Health (``kv_store_id``, a hash of its address) and how long
a block lives there (``kv_store_ttl_s``); a ``StoreGroup`` is the workers of one store,
one KV compatibility hash (same model, dtype, block size, weights: the same bytes) and
one ``--kv-compression`` (the encoding is part of a stored block's name). A group's run
is the leading blocks of a prompt that *some* worker of the group announced, each less
than the group's lifetime ago (the store drops blocks silently: TTL expiry and its own
eviction announce nothing). A block past it is
forgotten here (``PrefixIndex.forget_block``); a later announcement makes it new.

Blocks are named by the prompt's chained hashes under its salt, so a salted prompt
never matches another salt's (or no salt's) store blocks; a weight drop clears the
worker's entries, its store announcements with them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.router.dispatch.prefix.index import PrefixIndex
from pdserve.router.dispatch.workers.state import WorkerState


@dataclass(frozen=True, slots=True)
class StoreGroup:
    """The workers sharing one store's blocks (same store, KV layout and encoding)."""

    store_id: str
    compatibility_hash: str
    kv_compression: str = "none"  # the blocks' encoding is in their names in the store


@dataclass(frozen=True)
class StoreGroups:
    """Per worker id with a store, its group; per group, a block's lifetime (the
    shortest any of its workers reports)."""

    group_of: Mapping[str, StoreGroup]
    ttl_s: Mapping[StoreGroup, float]


def store_groups(workers: Iterable[WorkerState]) -> StoreGroups:
    """The store groups of ``workers`` (those naming a store and a lifetime)."""
    group_of: dict[str, StoreGroup] = {}
    ttl_s: dict[StoreGroup, float] = {}
    for w in workers:
        if not (w.kv_store_id and w.kv_store_ttl_s > 0 and w.worker_id):
            continue
        group = StoreGroup(w.kv_store_id, w.compatibility_hash, w.kv_compression)
        group_of[w.worker_id] = group
        ttl_s[group] = min(ttl_s.get(group, w.kv_store_ttl_s), w.kv_store_ttl_s)
    return StoreGroups(group_of, ttl_s)


def store_runs(index: PrefixIndex, hashes: Sequence[int], groups: StoreGroups
               ) -> dict[StoreGroup, int]:
    """Per group, the leading blocks of ``hashes`` (in the store tier's namespace) some
    worker of the group announced within the group's lifetime; groups with none
    omitted. A block too old for every group that announced it is forgotten."""
    runs: dict[StoreGroup, int] = {}
    alive = set(groups.ttl_s)
    now = index.now()
    n = 0
    for h in hashes:
        stored_at = index.stored_at(h)
        if stored_at is None:
            break
        here = {g for w in index.holders(h) if (g := groups.group_of.get(w)) is not None}
        fresh = {g for g in here if now - stored_at < groups.ttl_s[g]}
        if here and not fresh:
            index.forget_block(h)
        for g in alive - fresh:
            runs[g] = n
        alive &= fresh
        if not alive:
            break
        n += 1
    for g in alive:
        runs[g] = n
    return {g: blocks for g, blocks in runs.items() if blocks}
