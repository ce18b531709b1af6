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
from pdserve.kv_transfer.metadata import KVHandle, LeaseSpec, LoadSpec, PdserveConnectorMetadata
from pdserve.kv_transfer.push_plan import PushPlanner
from pdserve.kv_transfer.tier_plan import TierPlanner

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = logging.getLogger("pdserve.kv_transfer.scheduler")


class SchedulerSide:
    def __init__(self, config: ConnectorConfig, block_size: int,
                 tiers: TierPlanner | None = None) -> None:
        self._config = config
        self._block_size = block_size
        self._meta = PdserveConnectorMetadata()
        self._push = PushPlanner(block_size)
        self._continued: set[str] = set()  # requests whose grammar took their prior output
        self._tiers = tiers
        # Requests whose blocks a load (remote or tier) is still writing: never saved
        # to a tier (an abort mid-load finishes them before the load is reported).
        self._recving: set[str] = set()

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

    # ---- KV tiers --------------------------------------------------------------

    def _match_tier(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Full blocks after the engine's own hits that a tier holds: loaded
        asynchronously (the request waits, as for a remote load)."""
        if self._tiers is None:
            return 0, False
        count = self._tiers.match(request, num_computed_tokens)
        return (count, True) if count else (0, False)

    def _load_tier(self, request: Request, blocks: KVCacheBlocks,
                   num_external_tokens: int) -> None:
        if self._tiers is not None:
            self._tiers.plan_load(request, blocks, num_external_tokens, self._meta)
            if request.request_id in self._meta.tier_loads:
                self._recving.add(request.request_id)

    def _save_tier(self, request: Request, block_ids: list[int]) -> bool:
        if self._tiers is None:
            return False
        self._tiers.unmatch(request.request_id)  # matched, never allocated: unpin
        if not block_ids:
            return False
        if request.request_id in self._recving:  # aborted mid-load: its KV is incomplete
            return False
        return self._tiers.plan_save(request, block_ids, self._meta)

    def loads_from_tier(self, request_id: str) -> bool:
        return self._tiers is not None and self._tiers.loads(request_id)

    def tier_tokens(self, request_id: str) -> dict[str, int]:
        return {} if self._tiers is None else self._tiers.tokens_by_tier(request_id)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Transfers that ended: tier loads unpin their slots (a failed one's slots are
        forgotten), tier saves make theirs matchable."""
        self._recving.difference_update(output.finished_recving or ())
        if self._tiers is not None:
            self._tiers.update(output)

    def build_connector_meta(self, so: SchedulerOutput) -> PdserveConnectorMetadata:
        meta, self._meta = self._meta, PdserveConnectorMetadata()
        meta.idle = so.total_num_scheduled_tokens == 0
        meta.num_decode_seqs = sum(n == 1 for n in so.num_scheduled_tokens.values())
        meta.num_prefill_tokens = so.total_num_scheduled_tokens - meta.num_decode_seqs
        if self._push.num_tracked or so.scheduled_new_reqs:
            meta.pushes = self._push.plan(so)
        return meta
