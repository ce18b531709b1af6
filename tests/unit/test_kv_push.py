"""Layer-wise push without vLLM: the scheduler-side plan, the decode's inbox,
and pushes over TCP from a real second process."""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterable, Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, cast

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, compat, make_caches, push_kv

from pdserve.kv_transfer.base import (
    KVTransport,
    create_transport,
    push_transport_names,
    transport_names,
)
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.push.inbox import PushInbox
from pdserve.kv_transfer.push.plan import PushPlanner

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

BS = 16
# decode_side's factory: (dtype, capacity) -> (its KV port, its inbox, its caches)
DecodeSide = Callable[..., tuple[int, PushInbox, dict[str, torch.Tensor]]]


# ---- the plan: which blocks each prefill step pushes --------------------------------

def _new(req_id: str, num_prompt: int, blocks: list[int], computed: int = 0,
         push: bool = True) -> SimpleNamespace:
    params: dict[str, object] = {"do_remote_decode": True}
    if push:
        params["push"] = {"host": "h", "port": 1, "transfer_id": "x-" + req_id}
    return SimpleNamespace(
        req_id=req_id, prompt_token_ids=list(range(num_prompt)), block_ids=(blocks,),
        num_computed_tokens=computed,
        sampling_params=SimpleNamespace(extra_args={"kv_transfer_params": params}),
    )


def _output(new: Iterable[SimpleNamespace] = (),
            cached: dict[str, tuple[list[int] | None, int, bool]] | None = None,
            scheduled: dict[str, int] | None = None) -> SchedulerOutput:
    """A ``SchedulerOutput`` as the planner reads it."""
    cached = cached or {}
    return cast("SchedulerOutput", SimpleNamespace(
        scheduled_new_reqs=list(new),
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=list(cached), resumed_req_ids={r for r, c in cached.items() if c[2]},
            new_block_ids=[(c[0],) if c[0] is not None else None for c in cached.values()],
            num_computed_tokens=[c[1] for c in cached.values()],
        ),
        num_scheduled_tokens=dict(scheduled or {}),
    ))


def test_plan_pushes_the_whole_prompt_in_one_step_including_prefix_hits() -> None:
    plan = PushPlanner(BS)
    # 40 tokens = 3 blocks; the first block was a prefix-cache hit (computed 16)
    specs = plan.plan(_output([_new("a", 40, [7, 3, 9], computed=16)], scheduled={"a": 24}))
    spec = specs["a"]
    assert (spec.first_position, spec.block_ids, spec.num_blocks, spec.final) == (
        0, (7, 3, 9), 3, True)
    assert spec.target.transfer_id == "x-a"
    target = plan.forget("a")
    assert target is not None and target.transfer_id == "x-a"
    assert plan.forget("a") is None


def test_plan_follows_a_chunked_prefill_and_resends_the_partial_block() -> None:
    plan = PushPlanner(BS)
    first = plan.plan(_output([_new("a", 40, [5, 6])], scheduled={"a": 20}))["a"]
    assert (first.first_position, first.block_ids, first.final) == (0, (5, 6), False)
    second = plan.plan(_output(cached={"a": ([8], 20, False)}, scheduled={"a": 20}))["a"]
    # block 1 was left partial (tokens 16..19): it is sent again with the new block
    assert (second.first_position, second.block_ids, second.final) == (1, (6, 8), True)


def test_plan_ignores_requests_without_push_and_restarts_a_preempted_one() -> None:
    plan = PushPlanner(BS)
    specs = plan.plan(_output([_new("a", 20, [1, 2], push=False), _new("b", 20, [3, 4])],
                              scheduled={"a": 20, "b": 10}))
    assert set(specs) == {"b"}
    resumed = plan.plan(_output(cached={"b": ([11, 12], 0, True)}, scheduled={"b": 20}))["b"]
    assert (resumed.first_position, resumed.block_ids, resumed.final) == (0, (11, 12), True)
    assert plan.num_tracked == 1


# ---- the decode's inbox and pushes over TCP from another process ------------------

@pytest.fixture
def decode_side() -> Iterator[DecodeSide]:
    """A decode's KV endpoint with a push inbox, in this process."""
    made: list[KVTransport] = []

    def make(dtype: torch.dtype, capacity: int = 64 << 20
             ) -> tuple[int, PushInbox, dict[str, torch.Tensor]]:
        caches = {k: torch.zeros_like(v) for k, v in make_caches(0, dtype).items()}
        layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, BS)
        inbox = PushInbox(layout, capacity, ttl_s=30)
        transport = create_transport("tcp")
        channel = transport.push_channel()
        assert channel is not None
        channel.accept_pushes(inbox)
        port = transport.start(kv_caches=list(caches.values()), layout=layout,
                               leases=LeaseTable(), compat=compat(dtype), host="127.0.0.1",
                               port=0)
        made.append(transport)
        return port, inbox, caches

    yield make
    for transport in made:
        transport.close()


def _push_from_child(port: int, dtype: torch.dtype,
                     pushes: list[tuple[int, int, list[int], bool]], num_blocks: int,
                     checksum: bool = True, transfer_id: str = "t1") -> str | None:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=push_kv, args=(
        5, str(dtype).removeprefix("torch."), port, transfer_id, pushes, num_blocks, checksum,
        done), daemon=True)
    proc.start()
    try:
        return done.get(timeout=60)
    finally:
        proc.join(10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pushed_layers_land_bit_exact_in_the_decode_blocks(decode_side: DecodeSide,
                                                            dtype: torch.dtype) -> None:
    port, inbox, caches = decode_side(dtype)
    src = [4, 5, 9, 2]  # the prefill's blocks, prompt positions 0..3
    # a chunked prefill: positions 0-1 first (1 left partial), then 1-3, every layer
    pushes = [(layer, 0, src[:2], False) for layer in range(4)]
    pushes += [(layer, 1, src[1:], True) for layer in range(4)]
    assert _push_from_child(port, dtype, pushes, num_blocks=4) is None
    # this decode had a local prefix hit for position 0: it loads positions 1..3
    dst = [12, 3, 7]
    nbytes = inbox.load("t1", list(caches.values()), 1, dst, time.monotonic() + 5)
    want = make_caches(5, dtype)
    assert nbytes == 3 * 4 * want["layer.0"][0].numel() * want["layer.0"].element_size()
    for name, tensor in caches.items():
        for s, d in zip(src[1:], dst, strict=True):
            assert torch.equal(tensor[d].view(torch.uint8), want[name][s].view(torch.uint8))
        assert not tensor[[b for b in range(NUM_BLOCKS) if b not in dst]].any()
    assert inbox.num_bytes == 0  # consumed: its staging freed


def test_a_layer_is_not_taken_before_its_final_push(decode_side: DecodeSide) -> None:
    port, inbox, caches = decode_side(torch.float32)
    pushes = [(layer, 0, [1, 2], False) for layer in range(4)]
    assert _push_from_child(port, torch.float32, pushes, num_blocks=2) is None
    start = time.monotonic()
    with pytest.raises(TransferError, match="not complete in time"):
        inbox.load("t1", list(caches.values()), 0, [3, 4], start + 0.3)
    # It waited for the final pushes until the 0.3 s deadline: not less, and not until
    # something far longer (the inbox's 30 s TTL) ended the wait.
    assert 0.3 <= time.monotonic() - start < 15


def test_a_full_inbox_refuses_and_the_decode_learns_it_at_once(
        decode_side: DecodeSide) -> None:
    port, inbox, caches = decode_side(torch.float32, capacity=1024)
    error = _push_from_child(port, torch.float32, [(0, 0, [1], True)], num_blocks=1)
    assert error is not None and "inbox full" in error
    start = time.monotonic()
    with pytest.raises(TransferError, match="inbox full"):
        inbox.load("t1", list(caches.values()), 0, [3], start + 60)
    # Refused at once (milliseconds), not after waiting out the 60 s deadline.
    assert time.monotonic() - start < 20


def test_a_checksum_mismatch_fails_the_transfer() -> None:
    caches = {k: torch.zeros_like(v) for k, v in make_caches(0, torch.float32).items()}
    inbox = PushInbox(KVLayout.from_kv_caches(caches, NUM_BLOCKS, BS), 64 << 20, ttl_s=30)
    views = inbox.receive_views("t", 0, 0, 1, 1)
    views[0][:4] = b"abcd"  # what arrived is not what was sent
    with pytest.raises(TransferError, match="checksum mismatch"):
        inbox.commit("t", 0, 0, 1, final=True, crc32=0x1234)
    with pytest.raises(TransferError, match="checksum mismatch"):
        inbox.load("t", list(caches.values()), 0, [2], time.monotonic() + 5)
    assert not any(t.any() for t in caches.values())


def test_unclaimed_pushes_expire_and_free_their_memory() -> None:
    caches = make_caches(0, torch.float32)
    inbox = PushInbox(KVLayout.from_kv_caches(caches, NUM_BLOCKS, BS), 64 << 20, ttl_s=0.05)
    inbox.receive_views("t", 0, 0, 2, 2)
    block = caches["layer.0"][0]
    assert inbox.num_bytes == len(caches) * 2 * block.numel() * block.element_size()
    time.sleep(0.1)
    inbox.expire()
    assert inbox.num_bytes == 0
    with pytest.raises(TransferError, match="gone"):  # its entry went with its bytes
        inbox.commit("t", 0, 0, 2, final=True)


@pytest.mark.gpu
def test_pushed_layers_land_in_device_kv() -> None:
    """GPU path: the inbox stages in pinned host memory and copies into CUDA blocks."""
    caches = {k: torch.zeros_like(v, device="cuda") for k, v in
              make_caches(0, torch.float16).items()}
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, BS)
    inbox = PushInbox(layout, 64 << 20, ttl_s=30)
    want = make_caches(5, torch.float16)
    for layer, name in enumerate(caches):
        (view,) = inbox.receive_views("g", layer, 0, 2, 2)
        view[:] = want[name][[4, 5]].contiguous().view(torch.uint8).numpy().tobytes()
        inbox.commit("g", layer, 0, 2, final=True)
    inbox.load("g", list(caches.values()), 0, [8, 9], time.monotonic() + 5)
    for name, tensor in caches.items():
        assert torch.equal(tensor[[8, 9]].cpu(), want[name][[4, 5]])


@pytest.mark.parametrize("name", transport_names())
def test_the_registry_says_can_push_exactly_where_push_channel_is_given(name: str) -> None:
    # The engine host decides kv_push from the registry's names (no torch import);
    # they must agree with the typed capability the connector uses.
    transport = create_transport(name)
    try:
        assert (transport.push_channel() is not None) == (name in push_transport_names())
    finally:
        transport.close()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_pushed_from_device_kv_land_in_device_kv(dtype: torch.dtype) -> None:
    """GPU path end to end: a prefill's PushSender reads CUDA blocks (after the layer's
    event) and pushes them over tcp, CRC-checked, into a decode inbox over CUDA blocks
    (split K/V layout: two chunks per block)."""
    from pdserve.core.handle import PushTarget
    from pdserve.kv_transfer.push.sender import PushSender
    from pdserve.kv_transfer.push.spec import PushSpec

    want = make_caches(5, dtype, block_dim=1)
    src_kv = {k: v.to("cuda") for k, v in want.items()}
    dst_kv = {k: torch.zeros_like(v) for k, v in src_kv.items()}
    inbox = PushInbox(KVLayout.from_kv_caches(dst_kv, NUM_BLOCKS, BS), 64 << 20, ttl_s=30)
    decode, prefill = create_transport("tcp"), create_transport("tcp")
    try:
        channel = decode.push_channel()
        assert channel is not None
        channel.accept_pushes(inbox)
        port = decode.start(kv_caches=list(dst_kv.values()),
                            layout=KVLayout.from_kv_caches(dst_kv, NUM_BLOCKS, BS),
                            leases=LeaseTable(), compat=compat(dtype), host="127.0.0.1",
                            port=0)
        prefill.start(kv_caches=list(src_kv.values()),
                      layout=KVLayout.from_kv_caches(src_kv, NUM_BLOCKS, BS),
                      leases=LeaseTable(), compat=compat(dtype), host="127.0.0.1", port=0)
        pusher = prefill.push_channel()
        assert pusher is not None
        sender = PushSender(pusher, tp_rank=0, timeout_s=10, checksum=True)
        src = [4, 5, 9, 2]
        spec = PushSpec(PushTarget("127.0.0.1", port, "g"), 0, tuple(src), len(src), True)
        for layer in range(len(src_kv)):
            sender.submit({"r": spec}, layer, torch.device("cuda"))
        dst = [12, 3, 7, 8]
        inbox.load("g", list(dst_kv.values()), 0, dst, time.monotonic() + 10)
        sender.close()
        assert sender.num_pushes_failed == 0
        for name, tensor in dst_kv.items():
            got = tensor.cpu()
            for s, d in zip(src, dst, strict=True):
                assert torch.equal(got[:, d].view(torch.uint8), want[name][:, s].view(torch.uint8))
    finally:
        prefill.close()
        decode.close()
