"""The KV tiers' eviction and admission contract: which held block a full tier evicts
for a new one, and whether a new block is worth a slot at all.

Ownership stays with the tier's index (``TierIndex``): it owns the slots, which blocks
are held (matchable), being written, or pinned by loads in flight. A policy only keeps
an order over the held keys it was told of and chooses among them:

- ``on_insert(key, now, tenant)``: ``key`` became held (its save was committed, or a
  disk tier adopted it at start). ``tenant`` is the request's cache salt (None: none),
  since a tier key (a content hash) does not name its tenant.
- ``record_access(key, now)``: a held ``key`` was looked up, matched or saved again.
- ``admit(key, now, tenant) -> bool``: ``key`` is not held and a save wants a slot for
  it; False: the tier stores nothing and evicts nothing for it. Called once per
  wanted key (frequency policies count it as an access).
- ``victim(now, evictable, tenant) -> key | None``: the held key to evict so that
  ``tenant``'s new block gets a slot. It must be a key the policy was told is held and
  for which ``evictable(key)`` is True (False: pinned); None when there is none, and
  the tier then stores nothing. Choosing does not forget the key: the tier calls
  ``on_remove`` for it.
- ``on_remove(key)``: ``key`` is no longer held (evicted, discarded, expired, or the
  weights changed). Never called for a key that was not held.
- ``expired(now) -> list``: held keys whose lifetime ended (TTL); the tier stops
  matching them and frees their slots (a pinned one once unpinned), then calls
  ``on_remove`` for each.

``now`` is the tier's clock in seconds (monotonic on a worker, the trace's time in
``pdserve bench cache-sim``). Keys are bytes, opaque to the policy: vLLM's block
hashes on a worker, a trace's ``hash_ids`` as bytes in the simulator. A policy is called from
one thread (the connector's scheduler side) and never blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

Key = bytes
Evictable = Callable[[Key], bool]


class TierPolicy(Protocol):
    def on_insert(self, key: Key, now: float, tenant: str | None) -> None: ...

    def record_access(self, key: Key, now: float) -> None: ...

    def admit(self, key: Key, now: float, tenant: str | None) -> bool: ...

    def victim(self, now: float, evictable: Evictable, tenant: str | None) -> Key | None: ...

    def on_remove(self, key: Key) -> None: ...

    def expired(self, now: float) -> list[Key]: ...
