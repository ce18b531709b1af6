"""ucx transport: KV bytes over UCX tagged messages (``ucxx``, PyPI ``ucxx-cu12``).

Sends and receives go straight from and into vLLM's KV tensors: host memory on
CPU, device memory on GPU (UCX moves CUDA buffers itself, over NVLink/IB/cuda_ipc
where it has them). The standard ``UCX_*`` environment variables apply (e.g.
``UCX_TLS``); on one host UCX picks shared memory / CMA.

Setup rides the control channel: op ``ucx_connect`` swaps worker addresses and
each side makes an endpoint to the other. The decode side posts a tagged
receive per chunk before asking for the pull; the prefill side sends each chunk
with the tag the decode chose. Each worker runs UCX's own progress thread in
event mode (epoll, no spinning); waits on requests are bounded polls with
deadlines. A failed pull closes that peer's endpoints (which cancels their
outstanding requests, so nothing lands in blocks after a failure); the next
pull connects anew.

Endpoint error handling (UCX "peer" mode) is off by default because UCX refuses
shared-memory transports under it; a dead peer is noticed through the control
connection and the deadlines instead. ``PDSERVE_UCX_ERROR_HANDLING=1`` turns it on.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch

from pdserve.kv_transfer.base import PeerAddress, TransportOptions
from pdserve.kv_transfer.coded_pull import CodedPullTransport
from pdserve.kv_transfer.control.channel import Handler
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_msg,
    send_msg,
    set_deadline,
    wait_done,
)
from pdserve.kv_transfer.layout import as_bytes

logger = logging.getLogger("pdserve.kv_transfer.ucx")

_EPOLL_TIMEOUT_MS = 100
_INDEX_BITS = 24


def _ucx() -> Any:
    from ucxx._lib import libucxx  # imported on first use: the CLI never loads UCX

    return libucxx


class UcxTransport(CodedPullTransport):
    name: ClassVar[str] = "ucx"

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self._client_id = uuid.uuid4().hex
        self._error_handling = os.environ.get("PDSERVE_UCX_ERROR_HANDLING", "0") == "1"
        self._worker: Any = None
        self._context: Any = None
        self._eps: dict[PeerAddress, Any] = {}  # as receiver, per prefill peer
        self._served: dict[str, Any] = {}  # as sender, per decode client id
        self._lock = threading.Lock()
        self._connect_lock = threading.Lock()
        self._next_tag = 0

    # ---- hooks -----------------------------------------------------------------

    def _start_data(self, host: str) -> dict[str, Any]:
        ucx = _ucx()
        self._context = ucx.UCXContext(feature_flags=(ucx.Feature.TAG, ucx.Feature.WAKEUP))
        self._worker = ucx.UCXWorker(self._context)
        assert self._layout is not None
        if self._layout.device == "cuda":
            device = torch.cuda.current_device()
            self._worker.set_progress_thread_start_callback(
                lambda: torch.cuda.set_device(device))
        self._worker.start_progress_thread(polling_mode=False, epoll_timeout=_EPOLL_TIMEOUT_MS)
        return {}

    def _close_data(self) -> None:
        with self._lock:
            eps = list(self._eps.values()) + list(self._served.values())
            self._eps.clear()
            self._served.clear()
        for ep in eps:
            _close_ep(ep)
        if self._worker is not None:
            self._worker.stop_progress_thread()
            self._worker = None

    def _extra_ops(self) -> dict[str, Handler]:
        return {"ucx_connect": self._on_connect}

    def _on_connect(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """Sender side of ``ucx_connect``: an endpoint to the client's worker."""
        ep = self._endpoint_to(bytes.fromhex(str(msg["address"])))
        with self._lock:
            old = self._served.pop(str(msg["client"]), None)
            self._served[str(msg["client"])] = ep
        if old is not None:
            _close_ep(old)
        send_msg(conn, {"ok": True, "address": self._worker.address.tobytes().hex()})

    def _send_blocks(self, conn: socket.socket, msg: dict[str, Any],
                     chunks: Sequence[torch.Tensor], first_index: int, deadline: float) -> int:
        ucx = _ucx()
        with self._lock:
            ep = self._served.get(str(msg.get("client")))
        if ep is None:
            raise TransferError("no UCX endpoint for this client (ucx_connect first)")
        tag = int(msg["tag"])
        try:
            reqs = [ep.tag_send(_array(chunk), ucx.UCXXTag(tag + first_index + i))
                    for i, chunk in enumerate(chunks)]
            wait_done(lambda: all(r.completed for r in reqs), deadline, "UCX send", conn)
            for req in reqs:
                req.check_error()
        except Exception as exc:
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"UCX send failed: {exc}") from exc
        return sum(c.numel() * c.element_size() for c in chunks)

    def _on_pull_failed(self, msg: dict[str, Any]) -> None:
        with self._lock:
            ep = self._served.pop(str(msg.get("client")), None)
        if ep is not None:
            _close_ep(ep)  # cancels sends still queued on it

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> _UcxReceive:
        ucx = _ucx()
        if len(chunks) >= 1 << _INDEX_BITS:
            raise TransferError(f"too many chunks in one pull: {len(chunks)}")
        ep = self._ep_for(peer, conn, deadline)
        with self._lock:
            tag = (self._next_tag % (1 << 32)) << _INDEX_BITS
            self._next_tag += 1
        try:
            reqs = [ep.tag_recv(_array(chunk), ucx.UCXXTag(tag + i))
                    for i, chunk in enumerate(chunks)]
        except Exception as exc:
            self._drop(peer, ep)
            raise TransferError(f"UCX receive from {peer} failed: {exc}") from exc
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        return _UcxReceive({"client": self._client_id, "tag": tag}, reqs, nbytes,
                           lambda: self._drop(peer, ep))

    # ---- endpoints ---------------------------------------------------------------

    def _ep_for(self, peer: PeerAddress, conn: socket.socket, deadline: float) -> Any:
        with self._lock:
            ep = self._eps.get(peer)
        if ep is not None:
            return ep
        # One connect at a time: a second one would replace (and cancel) the first's endpoint.
        if not self._connect_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferError(f"UCX connect to {peer} busy until the deadline")
        try:
            with self._lock:
                ep = self._eps.get(peer)
            return ep if ep is not None else self._connect(peer, conn, deadline)
        finally:
            self._connect_lock.release()

    def _connect(self, peer: PeerAddress, conn: socket.socket, deadline: float) -> Any:
        set_deadline(conn, deadline)
        send_msg(conn, {"op": "ucx_connect", "client": self._client_id,
                        "address": self._worker.address.tobytes().hex()})
        reply = check_reply(recv_msg(conn), f"UCX connect to {peer}")
        ep = self._endpoint_to(bytes.fromhex(str(reply["address"])))
        with self._lock:
            self._eps[peer] = ep
        return ep

    def _endpoint_to(self, address: bytes) -> Any:
        ucx = _ucx()
        try:
            return ucx.UCXEndpoint.create_from_worker_address(
                self._worker, ucx.UCXAddress.create_from_buffer(address), self._error_handling)
        except Exception as exc:
            raise TransferError(f"cannot reach the UCX worker: {exc}") from exc

    def _drop(self, peer: PeerAddress, ep: Any) -> None:
        with self._lock:
            if self._eps.get(peer) is ep:
                del self._eps[peer]
        _close_ep(ep)


class _UcxReceive:
    """Posted tagged receives of one pull."""

    def __init__(self, fields: dict[str, Any], reqs: list[Any], nbytes: int,
                 drop: Callable[[], None]) -> None:
        self.fields = fields
        self._reqs = reqs
        self._nbytes = nbytes
        self._drop = drop
        self._done = False

    def receive(self, conn: socket.socket, deadline: float) -> int:
        try:
            wait_done(lambda: all(r.completed for r in self._reqs), deadline, "UCX receive")
            for req in self._reqs:
                req.check_error()
        except Exception as exc:
            self._done = True
            self._drop()  # closing the endpoint cancels what is still posted
            if isinstance(exc, TransferError):
                raise
            raise TransferError(f"UCX receive failed: {exc}") from exc
        self._done = True
        return self._nbytes

    def abort(self) -> None:
        if not self._done:
            self._done = True
            if not all(r.completed for r in self._reqs):
                self._drop()  # closing the endpoint cancels the posted receives


def _array(chunk: torch.Tensor) -> Any:
    from ucxx._lib.arr import Array

    if chunk.device.type == "cpu":
        return Array(as_bytes(chunk))
    return Array(chunk.view(torch.uint8))  # __cuda_array_interface__, any dtype


def _close_ep(ep: Any) -> None:
    try:
        ep.close()  # non-blocking; cancels the endpoint's outstanding requests
    except Exception as exc:  # an endpoint to a dead peer may refuse; it is dropped anyway
        logger.debug("UCX endpoint close: %s", exc)
