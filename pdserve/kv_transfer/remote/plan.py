"""The cluster KV store's plan, on the connector's scheduler side: how many of a new
request's blocks load from the store, which of a finished request's blocks are
published to it, and what the worker side's reports teach.

A prompt's blocks are looked for in the engine's cache (vLLM), the worker's own tiers,
a peer's host tier (the pool), then the store: the blocks after those are named
(``names.py``: model, weights, tenant, KV format, tokens) and looked up in one round
trip (``lookup_prefix``: the contiguous run from the first). The run is loaded only
when ``FetchDecision`` says fetching beats computing it, and only from
``MIN_FETCH_BLOCKS`` blocks on (a round trip for one block rarely pays). A lookup that
fails (the store down, stopped, full of errors) costs at most the store's deadline and
suspends lookups for ``BACKOFF_S``: requests are computed meanwhile, never delayed
again and again. A load that finds a block missing (expired or evicted since the
lookup) or corrupt stops there: the worker side reports that block and every one after
it as load errors, and vLLM recomputes from the first (``kv_load_failure_policy=
"recompute"``), keeping the blocks before it (the engine's, the tiers', the store's).

A finished request's computed full blocks that the store is not known to hold and
that its admission policy admits (``admission.py``, ``--kv-store-admission``: all by
default; up to the first refused block, so what is written stays a prefix) are
published behind it: the worker side copies them out of the cache (the blocks stay
allocated until then), and a background thread writes them; the request never waits
for the store. Published blocks are announced to the router (KV events, tier
``store``), since any worker on the store can load them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pdserve.core.block_hash import STORE_TIER, chain_hashes, salt_root, tier_hashes
from pdserve.kv_transfer.metadata import PdserveConnectorMetadata, StoreCopy, StoreFeedback
from pdserve.kv_transfer.remote.admission import StoreAdmission
from pdserve.kv_transfer.remote.base import KVStore, StoreTimeoutError
from pdserve.kv_transfer.remote.decision import FetchDecision
from pdserve.kv_transfer.remote.engine_identity import for_request
from pdserve.kv_transfer.remote.names import BlockName, KVIdentity

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdserve.kv_transfer.store")

MIN_FETCH_BLOCKS = 1
MAX_LOAD_BYTES = 512 << 20  # one load's blocks at most (the rest is computed)
BACKOFF_S = 2.0  # lookups pause this long after a failed one
KNOWN_MAX = 200_000  # blocks remembered as held by the store (not published again)
ANNOUNCED_MAX = 1_000_000  # published blocks awaiting their TTL's end (older: removed early)

# The scheduler side's counters (GetLoad's kv_store_*; the worker side has its own).
COUNTS = ("store_lookups", "store_lookup_blocks", "store_hit_blocks", "store_lookup_errors",
          "store_lookup_timeouts", "store_lookups_skipped", "store_fetch_chosen",
          "store_compute_chosen", "store_fetch_blocks", "store_load_failed",
          "store_publish_blocks", "store_not_admitted")


class StorePlanner:
    def __init__(self, open_store: Callable[[], KVStore], identity: KVIdentity,
                 block_size: int, decision: FetchDecision, ttl_s: float,
                 block_bytes: int = 0, admission: StoreAdmission | None = None) -> None:
        self._open = open_store
        self._admission = admission  # None: every new block is published
        self._store: KVStore | None = None
        self._identity = identity
        self._bs = block_size
        self.decision = decision
        self._ttl_s = ttl_s
        self._down_until = 0.0
        self._off = False  # the worker side turned the store off: nothing more to do
        self._max_load_blocks = max(MAX_LOAD_BYTES // block_bytes, 1) if block_bytes else 1 << 30
        # Per request, until allocated: the lookup's answer at a start block (the names
        # worth loading; none: absent, or computing was chosen), asked once per start.
        self._matched: dict[str, tuple[int, tuple[BlockName, ...]]] = {}
        self._loading: dict[str, tuple[StoreCopy, float]] = {}
        self._failed: set[str] = set()  # a store load failed: vLLM computes the rest
        self._gone: set[str] = set()  # ended while its load was in flight
        self._saving: dict[str, StoreCopy] = {}
        self._known: OrderedDict[str, float] = OrderedDict()  # key -> expiry (monotonic)
        self._changes: list[int] = []  # published blocks' pdserve hashes, to announce
        # What was announced, oldest first, with when its TTL ends: announced removed then
        # (the store expires it silently; the router and the KV-event mirror forget it).
        self._announced: deque[tuple[float, int]] = deque()
        self._counts = dict.fromkeys(COUNTS, 0)

    # ---- loads ---------------------------------------------------------------------

    def match(self, request: Request, num_tokens: int) -> int:
        """Tokens after ``num_tokens`` (a block boundary) the store holds and that are
        worth loading (0: none, or not worth it); one lookup per request and start."""
        req_id = request.request_id
        start = num_tokens // self._bs
        end = min((request.num_tokens - 1) // self._bs, start + self._max_load_blocks)
        if (num_tokens % self._bs or end - start < MIN_FETCH_BLOCKS or req_id in self._failed
                or self._off):
            self._matched.pop(req_id, None)
            return 0
        cached = self._matched.get(req_id)
        if cached is not None and cached[0] == start:
            return len(cached[1]) * self._bs
        names = self.names(request, end, start)
        found = self._lookup(names)
        if self._admission is not None and found:
            self._admission.found(names[:found])  # read: worth keeping admitted
        for name in names[found:found + 1]:  # proved absent: publish it again
            self._known.pop(name.key, None)
        worth = found >= MIN_FETCH_BLOCKS and self.decision.fetch(found)
        if found >= MIN_FETCH_BLOCKS:
            self._count(**{"store_fetch_chosen" if worth else "store_compute_chosen": 1})
        self._matched[req_id] = (start, tuple(names[:found]) if worth else ())
        return found * self._bs if worth else 0

    def num_matched(self, request_id: str) -> int:
        matched = self._matched.get(request_id)
        return 0 if matched is None else len(matched[1])

    def unmatch(self, request_id: str) -> None:
        self._matched.pop(request_id, None)

    def plan_load(self, request_id: str, dst: tuple[int, ...],
                  meta: PdserveConnectorMetadata) -> int:
        """Load the first ``len(dst)`` matched blocks into ``dst``; the blocks planned."""
        matched = self._matched.pop(request_id, None)
        if matched is None or not dst or not matched[1]:
            return 0
        names = matched[1][:len(dst)]
        copy = StoreCopy(dst[:len(names)], names)
        meta.store_loads[request_id] = copy
        self._loading[request_id] = (copy, time.monotonic())
        self._count(store_fetch_blocks=len(names))
        return len(names)

    def tokens_loading(self, request_id: str) -> int:
        loading = self._loading.get(request_id)
        return 0 if loading is None else len(loading[0].names) * self._bs

    # ---- saves ---------------------------------------------------------------------

    def plan_save(self, request: Request, block_ids: list[int],
                  meta: PdserveConnectorMetadata, skip: int = 0) -> bool:
        """Publish a finished request's computed full blocks the store is not known to
        hold and the admission admits (those before the first it refuses), after its
        first ``skip`` (a decode's blocks its prefill computed, and
        publishes); True if there is anything to copy (its blocks then stay allocated)."""
        self._matched.pop(request.request_id, None)
        num = min(request.num_computed_tokens // self._bs, len(block_ids))
        if num <= 0 or self._off or self._store_down():
            return False
        now = time.monotonic()
        picked = [(i, n) for i, n in enumerate(self.names(request, num))
                  if i >= skip and not self._is_known(n.key, now)]
        if self._admission is not None and picked:  # a prefix of them: no hole
            cut = self._admission.run([n for _, n in picked], request.cache_salt, now)
            self._count(store_not_admitted=len(picked) - cut)
            picked = picked[:cut]
        if not picked:
            return False
        copy = StoreCopy(tuple(block_ids[i] for i, _ in picked), tuple(n for _, n in picked))
        meta.store_saves[request.request_id] = copy
        self._saving[request.request_id] = copy
        return True

    # ---- reports -------------------------------------------------------------------

    def update(self, output: KVConnectorOutput) -> None:
        failed = output.failed_recving or set()
        invalid = output.invalid_block_ids or set()
        now = time.monotonic()
        for req_id in output.finished_recving or ():
            loading = self._loading.pop(req_id, None)
            if loading is None:
                continue
            copy = loading[0]
            lost = 0 if req_id in failed else next(
                (i for i, b in enumerate(copy.block_ids) if b in invalid), None)
            if lost is not None:  # failed, or loaded up to block ``lost``
                if req_id not in self._gone:
                    self._failed.add(req_id)  # never asked again for this request
                self._count(store_load_failed=1)
                for name in copy.names[lost:]:  # a block that failed is not trusted held
                    self._known.pop(name.key, None)
            self._gone.discard(req_id)
        for req_id in output.finished_sending or ():
            self._saving.pop(req_id, None)  # copied out: the writer publishes it
        feedback = output.kv_connector_worker_meta
        if isinstance(feedback, StoreFeedback):
            self._learn(feedback, now)

    def _learn(self, feedback: StoreFeedback, now: float) -> None:
        """The worker side's report: timings for the decision, blocks the writer
        published (remembered, announced) and blocks it could not (forgotten); or that
        the worker side turned the store off (then this side stops too)."""
        if feedback.store_off and not self._off:
            self._off = True
            logger.warning("KV store off: the worker side turned it off (see its log); no "
                           "more lookups or publications")
        if feedback.per_token_ns:
            self.decision.on_per_token(feedback.per_token_ns * 1e-9)
        for nbytes, ns in feedback.loads:
            self.decision.on_load(nbytes, ns * 1e-9)
        for key in feedback.unpublished:
            self._known.pop(key, None)
        if feedback.published:
            expiry = now + 0.9 * self._ttl_s
            for key, block_hash in feedback.published:
                self._known[key] = expiry
                self._known.move_to_end(key)
                self._changes.append(block_hash)
                self._announced.append((now + self._ttl_s, block_hash))
            while len(self._known) > KNOWN_MAX:
                self._known.popitem(last=False)
            self._count(store_publish_blocks=len(feedback.published))

    def finished(self, request_id: str) -> None:
        """A request ended: nothing of it is kept (a load in flight is still reported)."""
        self._matched.pop(request_id, None)
        self._failed.discard(request_id)
        if request_id in self._loading:
            self._gone.add(request_id)

    def drop_all(self) -> int:
        """The weights changed: their blocks' names differ from now on (the version is
        in them), so nothing is deleted; the memory of what the store holds is."""
        dropped = len(self._known)
        self._known.clear()
        return dropped

    def take_changes(self, now: float | None = None) -> list[tuple[str, bool, list[int]]]:
        """The blocks published since the last call, then those whose TTL ended since
        (removed), in the store's namespace."""
        now = time.monotonic() if now is None else now
        out = []
        if self._changes:
            names, self._changes = self._changes, []
            out.append((STORE_TIER, True, tier_hashes(names, STORE_TIER)))
        gone = []
        while self._announced and (self._announced[0][0] <= now
                                   or len(self._announced) > ANNOUNCED_MAX):
            gone.append(self._announced.popleft()[1])
        if gone:
            out.append((STORE_TIER, False, tier_hashes(gone, STORE_TIER)))
        return out

    def take_counts(self) -> dict[str, Any]:
        counts = {k: v for k, v in self._counts.items() if v}
        self._counts = dict.fromkeys(COUNTS, 0)
        return counts

    # ---- helpers -------------------------------------------------------------------

    def names(self, request: Request, num_blocks: int, start: int = 0) -> list[BlockName]:
        """The store's names of the request's blocks ``start`` to ``num_blocks``."""
        salt = request.cache_salt
        hashes = chain_hashes(request.all_token_ids[:num_blocks * self._bs], self._bs,
                              salt_root(salt))
        if not hashes:
            return []
        identity = for_request(self._identity, salt)
        return [BlockName(identity, h, hashes[0]) for h in hashes[start:]]

    def _lookup(self, names: list[BlockName]) -> int:
        if self._store_down():
            self._count(store_lookups_skipped=1)
            return 0
        start = time.monotonic()
        try:
            store = self._connect()
            found = store.lookup_prefix(names)
        except Exception as exc:  # noqa: BLE001 - any failure is a miss, never the engine's
            self._down_until = time.monotonic() + BACKOFF_S
            self._count(store_lookup_errors=1,
                        store_lookup_timeouts=int(isinstance(exc, StoreTimeoutError)))
            logger.warning("KV store lookup failed, computing (lookups pause %.0f s): %s",
                           BACKOFF_S, exc)
            return 0
        self.decision.on_rtt(time.monotonic() - start)
        self._count(store_lookups=1, store_lookup_blocks=len(names), store_hit_blocks=found)
        return found

    def _connect(self) -> KVStore:
        if self._store is None:
            self._store = self._open()
        return self._store

    def _store_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _is_known(self, key: str, now: float) -> bool:
        expiry = self._known.get(key)
        if expiry is None:
            return False
        if expiry <= now:
            del self._known[key]
            return False
        self._known.move_to_end(key)
        return True

    def _count(self, **deltas: int) -> None:
        for key, value in deltas.items():
            self._counts[key] += value

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
