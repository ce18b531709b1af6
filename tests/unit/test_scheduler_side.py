"""The connector's scheduler side without an engine: which tokens a decode
loads, which remote blocks go into which local ones, what a prefill keeps under
a lease, and that each step's metadata starts empty.

vLLM's own ``KVCacheBlock``/``KVCacheBlocks`` stand for an allocation (a block
with a hash is a local prefix-cache hit); requests and scheduler outputs are
stand-ins carrying only what the scheduler side reads.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import RequestStatus

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.continuation import OUTPUT_IN_PROMPT
from pdserve.kv_transfer.metadata import KVHandle, LeaseSpec, LoadSpec
from pdserve.kv_transfer.scheduler_side import SchedulerSide

BS = 128  # vLLM's CPU block size
CONFIG = ConnectorConfig(engine_id="prefill-0", kv_host="10.0.0.1", kv_port=7000, lease_s=30.0)
REMOTE_BLOCKS = (11, 12, 13)  # the prefill's blocks of a 300-token prompt


def _handle(num_tokens: int = 300, block_ids: tuple[int, ...] = REMOTE_BLOCKS) -> KVHandle:
    return KVHandle(engine_id="prefill-0", remote_request_id="p-req", block_ids=block_ids,
                    num_tokens=num_tokens, transport="tcp", host="10.0.0.1", port=7000,
                    transfer_id="xfer-1", lease_deadline_unix_ns=0)


def _decode_request(num_prompt: int = 300, handle: KVHandle | None = None) -> Any:
    params = dict((handle or _handle(num_prompt)).to_params(), do_remote_prefill=True)
    # The decode's prompt is the prefill's prompt + its first token.
    return SimpleNamespace(request_id="d-req", kv_transfer_params=params,
                           num_tokens=num_prompt + 1, use_structured_output=False)


def _blocks(hit: list[int], new: list[int]) -> KVCacheBlocks:
    """An allocation: ``hit`` blocks are local prefix-cache hits, ``new`` are fresh."""
    hits = []
    for i, block_id in enumerate(hit):
        block = KVCacheBlock(block_id)
        block.set_block_hash(bytes([i + 1]) * 8)  # type: ignore[arg-type]
        hits.append(block)
    return KVCacheBlocks(([*hits, *(KVCacheBlock(b) for b in new)],))


def _step(side: SchedulerSide, num_scheduled: int = 1) -> Any:
    return side.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        total_num_scheduled_tokens=num_scheduled, scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={}))


# ---- decode: how many tokens come from the prefill -----------------------------------

def test_a_request_without_remote_prefill_loads_nothing() -> None:
    side = SchedulerSide(CONFIG, BS)
    plain = SimpleNamespace(request_id="r", kv_transfer_params=None, num_tokens=50,
                            use_structured_output=False)
    assert side.get_num_new_matched_tokens(plain, 0) == (0, False)  # type: ignore[arg-type]


@pytest.mark.parametrize(("num_computed", "expected"), [
    (0, (300, True)),  # nothing local: the whole prompt loads, asynchronously
    (256, (44, True)),  # two blocks were local prefix hits: only the rest loads
])
def test_matched_tokens_start_after_local_prefix_hits(
    num_computed: int, expected: tuple[int, bool]
) -> None:
    side = SchedulerSide(CONFIG, BS)
    assert side.get_num_new_matched_tokens(_decode_request(), num_computed) == expected


def test_the_last_token_is_always_computed_by_the_decode() -> None:
    side = SchedulerSide(CONFIG, BS)
    # a handle claiming more tokens than the decode prompt holds is capped at prompt - 1
    request = _decode_request(300, _handle(num_tokens=400))
    assert side.get_num_new_matched_tokens(request, 0) == (300, True)


def test_whole_prompt_cached_locally_matches_nothing() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request(256, _handle(256, (11, 12)))
    assert side.get_num_new_matched_tokens(request, 256) == (0, False)


# ---- decode: which remote blocks go into which local ones ----------------------------

def test_load_maps_every_block_including_the_partial_last_one() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request()
    side.update_state_after_alloc(request, _blocks([], [4, 5, 6]), 300)
    load = _step(side).loads["d-req"]
    # 300 tokens = 2 full blocks + 44 tokens in a third, partial block
    assert load == LoadSpec(_handle(), src_block_ids=(11, 12, 13), dst_block_ids=(4, 5, 6),
                            first_position=0)
    assert request.kv_transfer_params["do_remote_prefill"] is False  # never pulled twice


def test_load_starts_after_local_hits_at_their_position() -> None:
    side = SchedulerSide(CONFIG, BS)
    side.update_state_after_alloc(_decode_request(), _blocks([21, 22], [7]), 44)
    load = _step(side).loads["d-req"]
    assert (load.src_block_ids, load.dst_block_ids, load.first_position) == ((13,), (7,), 2)


def test_block_aligned_prompt_leaves_the_extra_allocated_block_alone() -> None:
    side = SchedulerSide(CONFIG, BS)
    # 256 tokens fill two blocks exactly; the decode allocated a third for its own token
    request = _decode_request(256, _handle(256, (11, 12)))
    side.update_state_after_alloc(request, _blocks([], [4, 5, 6]), 256)
    load = _step(side).loads["d-req"]
    assert (load.src_block_ids, load.dst_block_ids) == ((11, 12), (4, 5))


def test_whole_prompt_cached_still_tells_the_prefill_to_release() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request(256, _handle(256, (11, 12)))
    side.update_state_after_alloc(request, _blocks([21, 22], [23]), 0)
    meta = _step(side)
    assert meta.loads == {}
    assert meta.releases == [_handle(256, (11, 12))]


def test_a_handle_with_too_few_blocks_is_refused() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request(300, _handle(300, (11, 12)))
    with pytest.raises(RuntimeError, match="cannot map 3 remote blocks"):
        side.update_state_after_alloc(request, _blocks([], [4, 5, 6]), 300)


def test_a_preempted_request_is_not_loaded_twice() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request()
    side.update_state_after_alloc(request, _blocks([], [4, 5, 6]), 300)
    _step(side)
    side.update_state_after_alloc(request, _blocks([], [8, 9, 10]), 300)
    assert _step(side).loads == {}


def test_a_decode_request_finished_before_allocation_releases_the_prefill() -> None:
    side = SchedulerSide(CONFIG, BS)
    request = _decode_request()
    assert side.request_finished(request, []) == (False, None)
    assert _step(side).releases == [_handle()]


# ---- prefill: leases and the handle ---------------------------------------------------

def _prefill_request(status: RequestStatus = RequestStatus.FINISHED_LENGTH_CAPPED) -> Any:
    return SimpleNamespace(request_id="p-req", kv_transfer_params={"do_remote_decode": True},
                           status=status, num_computed_tokens=300)


def test_a_finished_prefill_keeps_its_blocks_under_a_lease() -> None:
    side = SchedulerSide(CONFIG, BS)
    before = time.time()
    delay_free, params = side.request_finished(_prefill_request(), [11, 12, 13])
    assert delay_free is True and params is not None
    handle = KVHandle.from_params(params)
    assert (handle.engine_id, handle.remote_request_id, handle.block_ids, handle.num_tokens,
            handle.host, handle.port, handle.pushed) == (
        "prefill-0", "p-req", REMOTE_BLOCKS, 300, "10.0.0.1", 7000, False)
    lease = _step(side).leases["p-req"]
    assert lease.block_ids == REMOTE_BLOCKS
    assert before + 30 <= lease.deadline <= time.time() + 30
    assert handle.lease_deadline_unix_ns == int(lease.deadline * 1e9)


@pytest.mark.parametrize(("status", "block_ids"), [
    (RequestStatus.FINISHED_STOPPED, [11]),  # stopped at its first token: no decode follows
    (RequestStatus.FINISHED_ABORTED, [11]),
    (RequestStatus.FINISHED_LENGTH_CAPPED, []),
])
def test_a_prefill_with_nothing_to_hand_over_takes_no_lease(
    status: RequestStatus, block_ids: list[int]
) -> None:
    side = SchedulerSide(CONFIG, BS)
    assert side.request_finished(_prefill_request(status), block_ids) == (False, None)
    assert _step(side).leases == {}


def test_connector_meta_is_new_every_step() -> None:
    side = SchedulerSide(CONFIG, BS)
    side.request_finished(_prefill_request(), [11, 12, 13])
    side.update_state_after_alloc(_decode_request(), _blocks([], [4, 5, 6]), 300)
    first = _step(side)
    assert set(first.leases) == {"p-req"} and set(first.loads) == {"d-req"}
    assert not first.idle
    second = _step(side, num_scheduled=0)
    assert (second.leases, second.loads, second.releases, second.pushes,
            second.push_cancels) == ({}, {}, [], {}, [])
    assert second.idle  # nothing scheduled: the worker may wait briefly for transfers
    assert first.leases == {"p-req": LeaseSpec(REMOTE_BLOCKS, first.leases["p-req"].deadline)}


def _schedule_pushed_prefill(side: SchedulerSide) -> Any:
    params = {"do_remote_decode": True,
              "push": {"host": "10.0.0.2", "port": 7100, "transfer_id": "push-1"}}
    new = SimpleNamespace(
        req_id="p-req", prompt_token_ids=list(range(300)), block_ids=(list(REMOTE_BLOCKS),),
        num_computed_tokens=0,
        sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params}))
    return side.build_connector_meta(SimpleNamespace(  # type: ignore[arg-type]
        total_num_scheduled_tokens=300, scheduled_new_reqs=[new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[]), num_scheduled_tokens={"p-req": 300}))


def test_a_pushed_prefill_hands_over_the_push_transfer() -> None:
    side = SchedulerSide(CONFIG, BS)
    push = _schedule_pushed_prefill(side).pushes["p-req"]
    assert (push.block_ids, push.first_position, push.final) == (REMOTE_BLOCKS, 0, True)
    _, params = side.request_finished(_prefill_request(), list(REMOTE_BLOCKS))
    assert params is not None
    handle = KVHandle.from_params(params)
    assert (handle.pushed, handle.transfer_id) == (True, "push-1")
    assert "p-req" in _step(side).leases


def test_a_pushed_prefill_that_stopped_cancels_the_push() -> None:
    side = SchedulerSide(CONFIG, BS)
    _schedule_pushed_prefill(side)
    assert side.request_finished(_prefill_request(RequestStatus.FINISHED_STOPPED),
                                 [11]) == (False, None)
    meta = _step(side)
    assert meta.leases == {}
    assert [t.transfer_id for t in meta.push_cancels] == ["push-1"]


# ---- a continued request resumes its grammar -----------------------------------------

class _Grammar:
    def __init__(self) -> None:
        self.accepted: list[int] = []

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        self.accepted += tokens
        return True


def _continued(prior: list[int] | None, grammar: Any) -> Any:
    extra = {} if prior is None else {OUTPUT_IN_PROMPT: prior}
    return SimpleNamespace(
        request_id="c-req", kv_transfer_params=None, num_tokens=10,
        use_structured_output=grammar is not None,
        structured_output_request=SimpleNamespace(grammar=grammar),
        sampling_params=SimpleNamespace(extra_args=extra))


def test_a_continued_request_resumes_its_grammar_after_its_output_once() -> None:
    side = SchedulerSide(CONFIG, BS)
    grammar = _Grammar()
    request = _continued([7, 8], grammar)
    side.get_num_new_matched_tokens(request, 0)
    side.get_num_new_matched_tokens(request, 0)  # again, as after a preemption
    assert grammar.accepted == [7, 8]
    side.request_finished(request, [])
    fresh = _Grammar()
    side.get_num_new_matched_tokens(_continued(None, fresh), 0)  # a request that starts
    assert fresh.accepted == []
