"""torch transport: KV bytes over torch.distributed point-to-point.

NCCL on CUDA, RCCL on ROCm (torch's ``nccl`` backend there), gloo on CPU. vLLM
already owns the default process group, so each (prefill, decode) pair builds
its own 2-rank group directly (``ProcessGroupGloo``/``ProcessGroupNCCL`` over a
``TCPStore`` the prefill side hosts), lazily on the first pull and negotiated
on the control channel (op ``torch_group``). Rank 0 is the prefill (sender),
rank 1 the decode (receiver). Any failure tears the pair's group down; the next
pull builds a new one (a new generation, a new store).

Pulls over one group are serialised on the decode side, so NCCL's in-order
matching holds; gloo tags carry the chunk index anyway.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from pdserve.kv_transfer.base import PeerAddress
from pdserve.kv_transfer.coded_pull import CodedPullTransport
from pdserve.kv_transfer.control.channel import Handler
from pdserve.kv_transfer.control.wire import (
    TransferError,
    check_reply,
    recv_msg,
    send_msg,
    set_deadline,
)

logger = logging.getLogger("pdserve.kv_transfer.torch")

# Bounds building a pair's group (both sides must join within it).
GROUP_SETUP_S = 30.0
_SENDER, _RECEIVER = 0, 1


@dataclass
class _PairGroup:
    pg: Any  # dist.ProcessGroup backend (gloo or NCCL)
    store: Any  # the TCPStore, kept alive with the group
    gen: int
    lock: threading.Lock


def backend_for(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


class TorchTransport(CodedPullTransport):
    name: ClassVar[str] = "torch"

    def __init__(self, options: Any = None) -> None:
        super().__init__(options)
        self._client_id = uuid.uuid4().hex
        self._backend = "gloo"
        self._groups: dict[PeerAddress, _PairGroup] = {}  # as receiver, per prefill peer
        self._served: dict[str, _PairGroup] = {}  # as sender, per decode client id
        self._groups_lock = threading.Lock()
        self._setup_lock = threading.Lock()  # one group built at a time, as receiver
        self._next_gen = 0
        self._next_tag = 0

    # ---- hooks -----------------------------------------------------------------

    def _start_data(self, host: str) -> dict[str, Any]:
        assert self._layout is not None
        self._backend = backend_for(self._layout.device)
        return {"torch_backend": self._backend}

    def _close_data(self) -> None:
        with self._groups_lock:
            groups = list(self._groups.values()) + list(self._served.values())
            self._groups.clear()
            self._served.clear()
        for group in groups:
            _shutdown(group)

    def _extra_ops(self) -> dict[str, Handler]:
        return {"torch_group": self._on_group}

    def _send_blocks(self, conn: socket.socket, msg: dict[str, Any],
                     chunks: Sequence[torch.Tensor], first_index: int, deadline: float) -> int:
        with self._groups_lock:
            group = self._served.get(str(msg.get("client")))
        if group is None or group.gen != msg.get("gen"):
            raise TransferError(f"no torch group generation {msg.get('gen')} for this client")
        tag = int(msg["tag"])
        try:
            works = [group.pg.send([chunk], _RECEIVER, tag + first_index + i)
                     for i, chunk in enumerate(chunks)]
        except (RuntimeError, ValueError) as exc:  # the pair is broken, or a tensor NCCL refuses
            raise TransferError(f"torch send failed: {exc}") from exc
        _wait_all(works, deadline, "send")
        return sum(c.numel() * c.element_size() for c in chunks)

    def _on_pull_failed(self, msg: dict[str, Any]) -> None:
        with self._groups_lock:
            group = self._served.pop(str(msg.get("client")), None)
        if group is not None:
            _shutdown(group)

    def _open_receive(self, peer: PeerAddress, conn: socket.socket,
                      chunks: Sequence[torch.Tensor], deadline: float) -> _GroupReceive:
        group = self._group_for(peer, conn, deadline)
        if not group.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferError(f"torch group with {peer} busy until the deadline")
        with self._groups_lock:
            tag = (self._next_tag % 1024) << 21
            self._next_tag += 1
        if len(chunks) >= 1 << 21:
            group.lock.release()
            raise TransferError(f"too many chunks in one pull: {len(chunks)}")
        try:
            works = [group.pg.recv([chunk], _SENDER, tag + i) for i, chunk in enumerate(chunks)]
        except RuntimeError as exc:
            group.lock.release()
            self._drop(peer, group)
            raise TransferError(f"torch recv to {peer} failed: {exc}") from exc
        fields = {"client": self._client_id, "gen": group.gen, "tag": tag}
        nbytes = sum(c.numel() * c.element_size() for c in chunks)
        return _GroupReceive(fields, works, nbytes, group, lambda: self._drop(peer, group))

    # ---- the pair's group --------------------------------------------------------

    def _group_for(self, peer: PeerAddress, conn: socket.socket,
                   deadline: float) -> _PairGroup:
        if not self._setup_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise TransferError(f"torch group setup with {peer} busy until the deadline")
        try:
            with self._groups_lock:
                group = self._groups.get(peer)
                if group is not None:
                    return group
                gen = self._next_gen
                self._next_gen += 1
            return self._join_group(peer, conn, gen, deadline)
        finally:
            self._setup_lock.release()

    def _join_group(self, peer: PeerAddress, conn: socket.socket, gen: int,
                    deadline: float) -> _PairGroup:
        set_deadline(conn, deadline)
        send_msg(conn, {"op": "torch_group", "client": self._client_id, "gen": gen})
        reply = check_reply(recv_msg(conn), f"torch group setup with {peer}")
        timeout = min(GROUP_SETUP_S, max(0.1, deadline - time.monotonic()))
        try:
            store = dist.TCPStore(str(reply["host"]), int(reply["port"]), world_size=2,
                                  is_master=False, timeout=timedelta(seconds=timeout))
            pg = _new_group(self._backend, store, self._group_prefix(self._client_id, gen),
                            _RECEIVER, conn.getsockname()[0], timeout)
        except (RuntimeError, ValueError) as exc:  # DistStoreError/DistNetworkError included
            raise TransferError(f"cannot join torch group with {peer}: {exc}") from exc
        group = _PairGroup(pg, store, gen, threading.Lock())
        with self._groups_lock:
            self._groups[peer] = group
        logger.info("torch %s group gen %d with %s ready", self._backend, gen, peer)
        return group

    def _on_group(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        """Sender side of ``torch_group``: host a store, reply, then join the group."""
        client, gen = str(msg["client"]), int(msg["gen"])
        with self._groups_lock:
            old = self._served.pop(client, None)
        if old is not None:
            _shutdown(old)
        # The address the decode reached us on: it can reach the store and gloo there too.
        host = conn.getsockname()[0]
        store = dist.TCPStore(host, 0, world_size=2, is_master=True,
                              timeout=timedelta(seconds=GROUP_SETUP_S), wait_for_workers=False)
        send_msg(conn, {"ok": True, "host": host, "port": int(store.port)})
        try:
            pg = _new_group(self._backend, store, self._group_prefix(client, gen), _SENDER,
                            host, GROUP_SETUP_S)
        except (RuntimeError, ValueError) as exc:
            logger.warning("torch group gen %d with client %s failed: %s", gen, client, exc)
            raise TransferError(str(exc)) from exc
        with self._groups_lock:
            self._served[client] = _PairGroup(pg, store, gen, threading.Lock())

    def _group_prefix(self, client: str, gen: int) -> str:
        """The pair's keys in the store. The store itself takes anyone, but with a
        cluster secret its keys are derived from it: a peer that overheard the
        (authenticated) ``torch_group`` exchange still cannot name them to join."""
        prefix = f"pdserve/{client}/{gen}"
        secret = self.options.secret
        if secret is None:
            return prefix
        return f"{prefix}/{secret.mac(b'pdserve-torch-v1', prefix.encode()).hex()[:32]}"

    def _drop(self, peer: PeerAddress, group: _PairGroup) -> None:
        with self._groups_lock:
            if self._groups.get(peer) is group:
                del self._groups[peer]
        _shutdown(group)


class _GroupReceive:
    """Posted receives of one pull; holds the pair's lock until done or aborted."""

    def __init__(self, fields: dict[str, Any], works: list[Any], nbytes: int,
                 group: _PairGroup, drop: Callable[[], None]) -> None:
        self.fields = fields
        self._works = works
        self._nbytes = nbytes
        self._group = group
        self._drop = drop
        self._open = True

    def receive(self, conn: socket.socket, deadline: float) -> int:
        try:
            _wait_all(self._works, deadline, "recv")
        except TransferError:
            self.abort()
            raise
        self._close()
        return self._nbytes

    def abort(self) -> None:
        if not self._open:
            return
        self._close()
        # Aborting the group cancels the posted receives (a work cannot be cancelled
        # alone) and a half-done pull leaves the pair's ordering unknown anyway.
        self._drop()

    def _close(self) -> None:
        if self._open:
            self._open = False
            self._group.lock.release()


def _new_group(backend: str, store: Any, prefix: str, rank: int, host: str,
               timeout_s: float) -> Any:
    prefixed = dist.PrefixStore(prefix, store)
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
        pg.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return pg
    # Gloo's own options (its devices) are _Options at run time (Options is Backend's).
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch's stubs
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def _wait_all(works: Sequence[Any], deadline: float, what: str) -> None:
    """Block on each work up to ``deadline`` (gloo only learns of completion in
    ``wait``, so there is nothing to poll); a dead peer fails the wait early."""
    for work in works:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferError(f"torch {what} exceeded its deadline")
        try:
            if not work.wait(timedelta(seconds=remaining)):
                raise TransferError(f"torch {what} exceeded its deadline")
        except RuntimeError as exc:  # peer gone, timeout, aborted
            raise TransferError(f"torch {what} failed: {exc}") from exc
    if works and torch.cuda.is_available() and torch.cuda.is_initialized():
        # NCCL's wait orders this thread's stream after the transfer; make the host wait
        # too, so the trailer (sender) and the loaded blocks (receiver) follow the bytes.
        torch.cuda.current_stream().synchronize()


def _shutdown(group: _PairGroup) -> None:
    try:
        group.pg.abort()
    except (RuntimeError, AttributeError) as exc:
        logger.debug("torch group abort: %s", exc)
