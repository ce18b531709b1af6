"""The worker side of the KV-event relay over a ``KvCacheMirror``: what
``StreamKvEvents`` and ``GetKvSnapshot`` send, as pdserve types (the servicer
converts them). Shared by the vLLM prefill worker and the simulated one."""

from __future__ import annotations

from collections.abc import AsyncGenerator

from pdserve.core.types import KvChange, KvSnapshot
from pdserve.worker.kv.mirror import KvCacheMirror

HEARTBEAT_S = 2.0


async def kv_changes(mirror: KvCacheMirror, heartbeat_s: float = HEARTBEAT_S
                     ) -> AsyncGenerator[KvChange, None]:
    """First a heartbeat with the current seq, then every batch in order (with
    heartbeats while idle) until the caller closes the iterator."""
    sub = mirror.subscribe()
    try:
        yield KvChange(mirror.seq)
        while True:
            yield await sub.next(heartbeat_s)
    finally:
        sub.close()


def kv_snapshot(mirror: KvCacheMirror, worker_id: str) -> KvSnapshot:
    seq, hashes = mirror.snapshot()
    return KvSnapshot(seq=seq, block_hashes=tuple(hashes), block_size=mirror.block_size,
                      worker_id=worker_id)
