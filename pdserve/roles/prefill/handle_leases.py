"""The KV handles a prefill worker has handed out and still holds, by request id.

A handle's blocks stay with the prefill engine until the decode loads them (the
connector then frees them by itself), the router aborts the request (we release
them over the KV control endpoint), or the lease expires (the connector frees
them; we forget the handle).
"""

from __future__ import annotations

import logging

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.handle import KVHandle
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.tls import KvTls
from pdserve.kv_transfer.control.wire import TransferError

logger = logging.getLogger("pdserve.worker")
_CONTROL_TIMEOUT_S = 10.0


class HandleLeases:
    def __init__(self) -> None:
        self._handles: dict[str, KVHandle] = {}

    def __len__(self) -> int:
        return len(self._handles)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._handles

    def hold(self, request_id: str, handle: KVHandle) -> None:
        self._handles[request_id] = handle

    def request_ids(self) -> list[str]:
        return list(self._handles)

    def pop(self, request_id: str) -> KVHandle | None:
        return self._handles.pop(request_id, None)

    def prune(self, now_ns: int) -> None:
        """Forget handles whose lease ended before ``now_ns`` (unix ns)."""
        for rid in [r for r, h in self._handles.items() if h.lease_deadline_unix_ns < now_ns]:
            del self._handles[rid]


def release_over_control(handle: KVHandle, secret: ClusterSecret | None = None,
                         tls: KvTls | None = None) -> None:
    """Ask the engine's KV endpoint to free ``handle``'s blocks (blocking), over mutual
    TLS with ``tls``, proving the cluster ``secret`` first if there is one. A failure is
    only logged: the lease expires on its own."""
    try:
        request_once(handle.host, handle.port,
                     {"op": "release", "req": handle.remote_request_id}, _CONTROL_TIMEOUT_S,
                     secret, tls)
    except TransferError as exc:
        logger.warning("release of %s failed: %s", handle.remote_request_id, exc)
