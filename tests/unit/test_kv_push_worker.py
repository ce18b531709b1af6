"""The connector's worker side, prefill and decode, without vLLM: a push taken
from the inbox, and a refused push that falls back to a pull. Both bit-exact."""

from __future__ import annotations

import time

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, compat, make_caches, wait_until

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.metadata import (
    KVHandle,
    LeaseSpec,
    LoadSpec,
    PdserveConnectorMetadata,
    PushSpec,
    PushTarget,
)
from pdserve.kv_transfer.worker_side import WorkerSide

BS = 16


def _side(engine_id: str, caches: dict[str, torch.Tensor], inbox_mib: int) -> WorkerSide:
    config = ConnectorConfig(engine_id=engine_id, kv_bind_host="127.0.0.1", kv_port=0,
                             push_inbox_mib=inbox_mib, push_wait_s=5.0, kv_checksum=True)
    side = WorkerSide(config, compat(torch.float32), 0, BS, NUM_BLOCKS)
    side.register_kv_caches(caches)
    return side


def _wait(side: WorkerSide, pick: int, req_id: str) -> tuple[set[str], set[str], set[str]]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        polled = side.poll()
        if req_id in polled[pick]:
            return polled
        time.sleep(0.01)
    raise AssertionError(f"{req_id} never finished")


@pytest.mark.parametrize("inbox_mib", [64, 0], ids=["pushed", "inbox-full-pulls"])
def test_decode_takes_pushed_kv_or_pulls_it(inbox_mib: int) -> None:
    src_caches = make_caches(9, torch.float32)
    dst_caches = {k: torch.zeros_like(v) for k, v in src_caches.items()}
    prefill = _side("p", src_caches, 64)
    decode = _side("d", dst_caches, inbox_mib)
    try:
        src, dst = (5, 6, 2), (9, 10, 11)
        target = PushTarget("127.0.0.1", decode.port, "xfer-1")
        # Prefill's step: hold the blocks, push every layer as the forward pass saves it.
        step = PdserveConnectorMetadata(
            leases={"p-req": LeaseSpec(src, time.time() + 30)},
            pushes={"p-req": PushSpec(target, 0, src, len(src), final=True)})
        prefill.start_step(step)
        for name in src_caches:
            prefill.save_layer(name, step)
        handle = KVHandle("p", "p-req", src, 40, "tcp", "127.0.0.1", prefill.port, "xfer-1",
                          time.time_ns() + 30 * 10**9, pushed=True)
        decode.start_step(PdserveConnectorMetadata(loads={"d-req": LoadSpec(handle, src, dst)}))
        _, recving, failed = _wait(decode, 1, "d-req")
        assert failed == set()
        for name, tensor in dst_caches.items():
            assert torch.equal(tensor[list(dst)], src_caches[name][list(src)])
        _wait(prefill, 0, "p-req")  # the prefill's lease ended: its blocks may be freed
        stats = decode._status_extra()
        pushed = inbox_mib > 0
        assert (stats["push_loads"], stats["push_fallbacks"]) == ((1, 0) if pushed else (0, 1))
        # The refused push is counted once its reply reaches the prefill's push thread,
        # which may be after the decode fell back and pulled: wait for the count.
        assert wait_until(lambda: prefill._status_extra()["pushes_failed"] == (0 if pushed else 1),
                          timeout_s=5)
        assert prefill._transport.stats()["transfers_completed"] == (0 if pushed else 1)
    finally:
        prefill.shutdown()
        decode.shutdown()
