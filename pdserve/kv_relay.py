"""The worker side of the KV-event relay: ``StreamKvEvents`` and ``GetKvSnapshot``
over a ``KvCacheMirror``, shared by the vLLM worker's and the simulated worker's
gRPC services."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdserve.kv_mirror import KvCacheMirror, KvChange
from pdserve.proto.pdserve.v1 import worker_pb2 as pb

HEARTBEAT_S = 2.0


def change_to_pb(change: KvChange) -> pb.KvEventBatch:
    return pb.KvEventBatch(seq=change.seq, cleared=change.cleared, stored=change.stored,
                           removed=change.removed)


async def stream_kv_events(
    mirror: KvCacheMirror | None, context: grpc.aio.ServicerContext,
    heartbeat_s: float = HEARTBEAT_S,
) -> AsyncIterator[pb.KvEventBatch]:
    """First a heartbeat with the current seq, then every batch in order (with
    heartbeats while idle) until the caller cancels."""
    if mirror is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no KV events")
        return
    sub = mirror.subscribe()
    try:
        yield change_to_pb(KvChange(mirror.seq))
        while True:
            yield change_to_pb(await sub.next(heartbeat_s))
    finally:
        sub.close()


async def kv_snapshot(mirror: KvCacheMirror | None, worker_id: str,
                      context: grpc.aio.ServicerContext) -> pb.KvSnapshot:
    if mirror is None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker publishes no KV events")
    assert mirror is not None
    seq, hashes = mirror.snapshot()
    return pb.KvSnapshot(seq=seq, block_hashes=hashes, block_size=mirror.block_size,
                         worker_id=worker_id)
