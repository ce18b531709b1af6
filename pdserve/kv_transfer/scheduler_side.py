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

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.continuation import OUTPUT_IN_PROMPT
from pdserve.kv_transfer.metadata import (
    KVHandle,
    LeaseSpec,
    LoadSpec,
    PdserveConnectorMetadata,
    TierCopy,
)
from pdserve.kv_transfer.push_plan import PushPlanner
from pdserve.kv_transfer.tier_index import TierIndex

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdserve.kv_transfer.scheduler")


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int, tier_slots: int = 0) -> None:
        self._config = config
        self._block_size = block_size
        self._meta = PdserveConnectorMetadata()
        self._push = PushPlanner(block_size)
        self._continued: set[str] = set()  # requests whose grammar took their prior output
        self._tier = TierIndex(tier_slots) if tier_slots else None
        self._tier_matched: dict[str, TierCopy] = {}  # matched, blocks not allocated yet
        self._tier_loading: dict[str, tuple[int, ...]] = {}  # slots pinned by a load
        self._tier_saving: dict[str, tuple[int, ...]] = {}  # slots being written

    @property
    def tier(self) -> TierIndex | None:
        return self._tier

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
        if not request.use_structured_output or request.request_id in self._continued:
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

    # ---- host tier -------------------------------------------------------------

    def _match_tier(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Full blocks after the engine's own hits that the host tier holds: loaded
        asynchronously, never the prompt's last token (it is computed here)."""
        tier = self._tier
        if tier is None:
            return 0, False
        self._unmatch(request.request_id)  # asked again: the last match was not allocated
        bs = self._block_size
        if num_computed_tokens % bs:
            return 0, False
        start, end = num_computed_tokens // bs, (request.num_tokens - 1) // bs
        hashes = tuple(request.block_hashes[start:end])
        slots = tuple(tier.match(hashes))
        if not slots:
            return 0, False
        tier.pin(slots)
        self._tier_matched[request.request_id] = TierCopy((), slots, hashes[:len(slots)])
        return len(slots) * bs, True

    def _unmatch(self, request_id: str) -> None:
        matched = self._tier_matched.pop(request_id, None)
        if matched is not None and self._tier is not None:
            self._tier.unpin(matched.slots)

    def _load_tier(self, request: Request, blocks: KVCacheBlocks,
                   num_external_tokens: int) -> None:
        matched = self._tier_matched.pop(request.request_id, None)
        if matched is None or self._tier is None:
            return
        num = num_external_tokens // self._block_size
        dst = tuple(blocks.get_unhashed_block_ids()[:num])
        if num == 0 or len(dst) != num or num > len(matched.slots):
            self._tier.unpin(matched.slots)
            if num:
                raise RuntimeError(f"request {request.request_id}: cannot map {num} host "
                                   f"tier blocks ({len(dst)} allocated)")
            return
        self._tier.unpin(matched.slots[num:])
        self._tier_loading[request.request_id] = matched.slots[:num]
        self._meta.tier_loads[request.request_id] = TierCopy(
            dst, matched.slots[:num], matched.hashes[:num])

    def _save_tier(self, request: Request, block_ids: list[int]) -> bool:
        """Plan the copy of a finished request's computed full blocks that the tier does
        not hold yet; True if there is one (its blocks then stay allocated)."""
        self._unmatch(request.request_id)
        if self._tier is None or not block_ids:
            return False
        num = min(request.num_computed_tokens // self._block_size,
                  len(request.block_hashes), len(block_ids))
        hashes = request.block_hashes[:num]
        reserved = self._tier.reserve(hashes)
        if not reserved:
            return False
        slots = tuple(slot for _, slot in reserved)
        self._tier_saving[request.request_id] = slots
        self._meta.tier_saves[request.request_id] = TierCopy(
            tuple(block_ids[i] for i, _ in reserved), slots,
            tuple(hashes[i] for i, _ in reserved))
        return True

    def loads_from_tier(self, request_id: str) -> bool:
        return request_id in self._tier_loading

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers that ended: loads unpin their slots (a failed one's slots are
        forgotten: their bytes were bad), saves make theirs matchable."""
        if self._tier is None:
            return
        failed = output.failed_recving or set()
        for req_id in output.finished_recving or ():
            slots = self._tier_loading.pop(req_id, None)
            if slots is not None:
                self._tier.unpin(slots)
                if req_id in failed:
                    self._tier.discard(slots)
        for req_id in output.finished_sending or ():
            slots = self._tier_saving.pop(req_id, None)
            if slots is not None:
                self._tier.commit(slots)

    def build_connector_meta(self, so: SchedulerOutput) -> PdserveConnectorMetadata:
        meta, self._meta = self._meta, PdserveConnectorMetadata()
        meta.idle = so.total_num_scheduled_tokens == 0
        meta.num_decode_seqs = sum(n == 1 for n in so.num_scheduled_tokens.values())
        meta.num_prefill_tokens = so.total_num_scheduled_tokens - meta.num_decode_seqs
        if self._push.num_tracked or so.scheduled_new_reqs:
            meta.pushes = self._push.plan(so)
        return meta
