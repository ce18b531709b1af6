"""The worker's subscriber to vLLM's own KV-event publisher (``ZmqEventPublisher``,
no engine): batches it missed (published before it connected, the gap) are
replayed from the publisher's replay socket, in order, before the live ones."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

from pdserve_testing import wait_until_async

from pdserve.core.block_hash import chain_hashes
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.vllm.kv_events import KvEventEndpoints, ZmqKvEventSource

BS = 16


async def test_missed_vllm_events_are_replayed_in_order(tmp_path: Path) -> None:
    from vllm.distributed.kv_events import (
        BlockRemoved,
        BlockStored,
        KVEventBatch,
        ZmqEventPublisher,
    )

    endpoints = KvEventEndpoints.for_worker(f"test-{uuid.uuid4().hex[:8]}", tmp_path)
    pub = ZmqEventPublisher(0, endpoint=endpoints.pub, replay_endpoint=endpoints.replay,
                            buffer_steps=1000)
    tokens = list(range(1, 1 + 40 * BS))
    ours = chain_hashes(tokens, BS)

    def stored(i: int) -> KVEventBatch:  # block i, chained on vLLM's hash of block i - 1
        ev = BlockStored(block_hashes=[f"v{i}".encode()],
                         parent_block_hash=f"v{i - 1}".encode() if i else None,
                         token_ids=tokens[i * BS:(i + 1) * BS], block_size=BS, lora_id=None,
                         medium="CPU", lora_name=None)
        return KVEventBatch(ts=time.time(), events=[ev])

    mirror = KvCacheMirror(BS)
    source = ZmqKvEventSource(endpoints, BS, mirror.apply, asyncio.get_running_loop())
    try:
        for i in range(3):  # nobody listens yet: seq 0-2 reach no subscriber
            pub.publish(stored(i))
        # Sent (and buffered for replay) before anyone subscribes, however slow the
        # publisher's thread is: its queue's items are marked done once sent.
        await asyncio.wait_for(asyncio.to_thread(pub._event_queue.join), 30)
        source.start()
        i = 3
        while len(mirror) < 3 and i < 30:  # live batches until the subscriber is connected
            pub.publish(stored(i))
            i += 1
            await asyncio.sleep(0.1)
        pub.publish(KVEventBatch(ts=time.time(), events=[
            BlockRemoved(block_hashes=[b"v0"], medium="CPU")]))
        assert await wait_until_async(lambda: 0 < len(mirror) and ours[0] not in mirror, 5)
        assert source.num_replayed >= 3 and source.num_lost == 0
        # Every block was chained (so its parent arrived first) and nothing is missing.
        assert set(mirror.snapshot()[1]) == set(ours[1:i])
    finally:
        source.close()
        pub.shutdown()
        endpoints.remove_files()
