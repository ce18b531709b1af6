"""The connector's scheduler side (runs in vLLM's EngineCore process).

Prefill: when a ``do_remote_decode`` request finishes length-capped (its one
token sampled), keep its blocks under a lease and return a KV handle.
Decode: for a ``do_remote_prefill`` request, report the handle's tokens as
loadable asynchronously, then tell the worker side which remote blocks go into
which of the blocks vLLM allocated. Nothing here touches the network.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING, Any

from vllm.v1.request import RequestStatus

from pdserve.core.handle import PoolSource
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.continuation import OUTPUT_IN_PROMPT
from pdserve.kv_transfer.metadata import (
    KVHandle,
    LeaseSpec,
    LoadSpec,
    PdserveConnectorMetadata,
    PoolLoad,
)
from pdserve.kv_transfer.push.plan import PushPlanner
from pdserve.kv_transfer.remote.plan import StorePlanner
from pdserve.kv_transfer.tiers.plan import TierPlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdserve.kv_transfer.scheduler")


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int,
                 tiers: TierPlanner | None = None, pool: bool = True,
                 store: StorePlanner | None = None) -> None:
        self._config = config
        self._block_size = block_size
        self._meta = PdserveConnectorMetadata()
        self._push = PushPlanner(block_size)
        self._continued: set[str] = set()  # requests whose grammar took their prior output
        self._tiers = tiers
        # Requests whose blocks a load (remote or tier) is still writing: never saved
        # to a tier (an abort mid-load finishes them before the load is reported).
        self._recving: set[str] = set()
        # The cluster KV pool: blocks a peer's host tier holds (found, not allocated
        # yet), and the tokens each loading request takes from it.
        self._pool = pool  # False: blocks are not named by their hashes (no pool loads)
        self._pool_matched: dict[str, tuple[PoolSource, tuple[bytes, ...]]] = {}
        self._pool_loading: dict[str, int] = {}
        self._pool_failed: set[str] = set()  # a pool load failed: the rest is computed
        self._store = store  # the cluster KV store (None: off)
        # Decode: blocks a request received from its prefill (which publishes them).
        self._received: dict[str, int] = {}

    @property
    def tiers(self) -> TierPlanner | None:
        return self._tiers

    # ---- decode ----------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        self._continue_grammar(request)
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return self._match_tier(request, num_computed_tokens)
        # Never the whole request: the last token (prefill's sampled one) is computed here.
        num_remote = min(int(params["num_tokens"]), request.num_tokens - 1)
        count = num_remote - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            self._load_tier(request, blocks, num_external_tokens)
            return
        params["do_remote_prefill"] = False  # one transfer per request, even if preempted
        handle = KVHandle.from_params(params)
        if num_external_tokens == 0:  # the local prefix cache covered it
            self._meta.releases.append(handle)
            return
        group = blocks.blocks[0]
        num_local = sum(1 for b in group if b.block_hash is not None and not b.is_null)
        end_token = num_local * self._block_size + num_external_tokens
        num_pull = -(-end_token // self._block_size) - num_local
        dst = blocks.get_unhashed_block_ids()[:num_pull]
        src = handle.block_ids[num_local : num_local + num_pull]
        if len(src) != num_pull or len(dst) != num_pull:
            raise RuntimeError(
                f"request {request.request_id}: cannot map {num_pull} remote blocks "
                f"(remote has {len(handle.block_ids)}, local allocated {len(dst)})"
            )
        self._recving.add(request.request_id)
        # full blocks only: the prefill publishes those, a partial last one it cannot
        self._received[request.request_id] = end_token // self._block_size
        self._meta.loads[request.request_id] = LoadSpec(
            handle, tuple(src), tuple(dst), first_position=num_local
        )

    def _continue_grammar(self, request: Request) -> None:
        """A call that continues a request (its prompt ends with output already produced:
        prefill's first token, tokens sent before a migration) resumes the structured-
        output grammar after that output, as one engine would be, not at its start.

        vLLM calls this hook for a waiting request once its grammar is compiled and
        before its first step, again after a preemption: the tokens are taken once. The
        grammar is the request's own (``accept_tokens`` is what vLLM's scheduler calls
        after each step); nothing of vLLM is patched. No reasoning parser runs in a
        pdserve engine, so the grammar applies from the first output token on."""
        if (not request.use_structured_output or request.request_id in self._continued
                or request.sampling_params is None):
            return
        prior = (request.sampling_params.extra_args or {}).get(OUTPUT_IN_PROMPT)
        structured = request.structured_output_request
        if not prior or structured is None:
            return
        grammar = structured.grammar
        if grammar is None or isinstance(grammar, Exception):
            return  # not compiled yet (asked again next step), or vLLM fails the request
        self._continued.add(request.request_id)
        if not grammar.accept_tokens(request.request_id, [int(t) for t in prior]):
            logger.warning("%s: the grammar refused the output it continues from",
                           request.request_id)

    # ---- prefill ---------------------------------------------------------------

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Blocks stay allocated (True) while leased to a decode, or while the host
        tier copies them: until the id comes back in ``finished_sending``."""
        self._continued.discard(request.request_id)
        saving = self._save_tier(request, block_ids)
        held, out = self._hand_over(request, block_ids)
        return held or saving, out

    def _hand_over(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        params = request.kv_transfer_params
        pushed_to = self._push.forget(request.request_id)
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # decode request aborted before allocation
            params["do_remote_prefill"] = False
            self._meta.releases.append(KVHandle.from_params(params))
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status != RequestStatus.FINISHED_LENGTH_CAPPED or not block_ids:
            if pushed_to is not None:  # free the decode's inbox now, not at expiry
                self._meta.push_cancels.append(pushed_to)
            return False, None  # stopped at its first token, or aborted: nothing to hand over
        deadline = time.time() + self._config.lease_s
        self._meta.leases[request.request_id] = LeaseSpec(tuple(block_ids), deadline)
        handle = KVHandle(
            engine_id=self._config.engine_id,
            remote_request_id=request.request_id,
            block_ids=tuple(block_ids),
            num_tokens=request.num_computed_tokens,
            transport=self._config.transport,
            host=self._config.kv_host,
            port=self._config.kv_port,
            transfer_id=pushed_to.transfer_id if pushed_to else uuid.uuid4().hex,
            lease_deadline_unix_ns=int(deadline * 1e9),
            pushed=pushed_to is not None,
        )
        return True, handle.to_params()

    # ---- KV tiers --------------------------------------------------------------

    def _match_tier(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Full blocks after the engine's own hits that a tier holds, then those the cluster
        store holds (worth fetching), then those a peer's host tier holds (the router named
        it: ``pool``), the order of the router's plan: loaded asynchronously (the request
        waits, as for a remote load)."""
        count = self._tiers.match(request, num_computed_tokens) if self._tiers else 0
        if self._store is not None:
            count += self._store.match(request, num_computed_tokens + count)
        count += self._match_pool(request, num_computed_tokens + count)
        return (count, True) if count else (0, False)

    def _match_pool(self, request: Request, num_tokens: int) -> int:
        self._pool_matched.pop(request.request_id, None)
        params = request.kv_transfer_params or {}
        if (not self._pool or "pool" not in params or num_tokens % self._block_size
                or request.request_id in self._pool_failed):
            return 0
        try:
            source = PoolSource.from_params(params["pool"])
        except ValueError as exc:
            logger.warning("%s: ignoring the KV pool source: %s", request.request_id, exc)
            return 0
        start = num_tokens // self._block_size
        end = min(source.num_blocks, (request.num_tokens - 1) // self._block_size,
                  len(request.block_hashes))
        if end <= start:
            return 0
        self._pool_matched[request.request_id] = (source, tuple(request.block_hashes[start:end]))
        return (end - start) * self._block_size

    def _load_tier(self, request: Request, blocks: KVCacheBlocks,
                   num_external_tokens: int) -> None:
        """The blocks vLLM allocated for external tokens: the first from this worker's
        tiers, the rest from the peer's (in the order ``_match_tier`` counted them)."""
        req_id = request.request_id
        num = num_external_tokens // self._block_size
        dst = tuple(blocks.get_unhashed_block_ids()[:num]) if num else ()
        if len(dst) != num:
            raise RuntimeError(f"request {req_id}: cannot map {num} loaded blocks "
                               f"({len(dst)} allocated)")
        matched = self._tiers.num_matched(req_id) if self._tiers is not None else 0
        num_tier = min(matched, num)
        if self._tiers is not None:
            self._tiers.plan_load(request, dst[:num_tier], self._meta)
        rest = dst[num_tier:]
        pool = self._pool_matched.pop(req_id, None)
        in_store = self._store.num_matched(req_id) if self._store is not None else 0
        ours = num_tier == matched  # else: not tokens this side reported
        num_store = min(in_store, len(rest)) if ours else 0
        if num_store and self._store is not None:
            self._store.plan_load(req_id, rest[:num_store], self._meta)
        rest = rest[num_store:]
        if rest and ours and num_store == in_store and pool is not None and len(
                rest) <= len(pool[1]):  # what the tiers and the store leave is the pool's
            source, hashes = pool
            self._meta.pool_loads[req_id] = PoolLoad(source.host, source.port,
                                                     hashes[:len(rest)], rest)
            self._pool_loading[req_id] = len(rest) * self._block_size
        elif rest:
            # Not tokens this side reported (a preempted request's second allocation):
            # nothing loads into them, as before the pool.
            logger.debug("%s: %d external blocks beyond the tiers' %d and the store's %d "
                         "are not the pool's", req_id, len(rest), num_tier, num_store)
        if self._store is not None:
            self._store.unmatch(req_id)
        elsewhere = (len(rest) if req_id in self._meta.pool_loads else 0) + num_store
        if self._tiers is not None:
            self._tiers.count_misses(req_id, elsewhere)
        if req_id in self._meta.tier_loads or elsewhere:
            self._recving.add(req_id)

    def _save_tier(self, request: Request, block_ids: list[int]) -> bool:
        self._pool_matched.pop(request.request_id, None)
        self._pool_failed.discard(request.request_id)
        # Aborted mid-pull: its failure, reported later, must not mark it again.
        self._pool_loading.pop(request.request_id, None)
        skip = self._received.pop(request.request_id, 0)
        if self._tiers is not None:
            self._tiers.unmatch(request.request_id)  # matched, never allocated: unpin
        if self._store is not None:
            self._store.finished(request.request_id)
        if not block_ids or request.request_id in self._recving:
            return False  # nothing, or aborted mid-load: its KV is incomplete
        saving = (self._tiers is not None
                  and self._tiers.plan_save(request, block_ids, self._meta))
        publishing = (self._store is not None
                      and self._store.plan_save(request, block_ids, self._meta, skip))
        return saving or publishing

    def tier_tokens(self, request_id: str) -> dict[str, int]:
        """The tokens a request loads from each tier: ``host``, ``disk``, ``pool``."""
        out = {} if self._tiers is None else self._tiers.tokens_by_tier(request_id)
        if request_id in self._pool_loading:
            out["pool"] = self._pool_loading[request_id]
        if self._store is not None and (store := self._store.tokens_loading(request_id)):
            out["store"] = store
        return out

    def reset_tiers(self) -> int:
        """Forget every tier block (their KV was computed under other weights)."""
        dropped = self._store.drop_all() if self._store is not None else 0
        return dropped + (self._tiers.drop_all() if self._tiers is not None else 0)

    def take_events(self) -> list[tuple[str, bool, list[int]]]:
        """The tiers' residency changes since the last step (``TierPlanner.take_changes``),
        then the blocks published to the store."""
        events = self._tiers.take_changes() if self._tiers is not None else []
        return events + (self._store.take_changes() if self._store is not None else [])

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers that ended: tier loads unpin their slots (a failed one's slots are
        forgotten), tier saves make theirs matchable."""
        self._recving.difference_update(output.finished_recving or ())
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            if self._pool_loading.pop(req_id, None) is not None and req_id in failed:
                self._pool_failed.add(req_id)  # vLLM recomputes: never ask the peer again
        if self._tiers is not None:
            self._tiers.update(output)
        if self._store is not None:
            self._store.update(output)

    def build_connector_meta(self, so: SchedulerOutput) -> PdserveConnectorMetadata:
        meta, self._meta = self._meta, PdserveConnectorMetadata()
        meta.idle = so.total_num_scheduled_tokens == 0
        if self._tiers is not None:
            meta.tier_counts = self._tiers.take_counts()
        if self._store is not None:
            meta.tier_counts.update(self._store.take_counts())
        meta.num_decode_seqs = sum(n == 1 for n in so.num_scheduled_tokens.values())
        meta.num_prefill_tokens = so.total_num_scheduled_tokens - meta.num_decode_seqs
        if self._push.num_tracked or so.scheduled_new_reqs:
            meta.pushes = self._push.plan(so)
        return meta
