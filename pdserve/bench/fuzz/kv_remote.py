"""A worker's KV port as the fuzz target (``pdserve bench fuzz --target host:port``).

From outside, less is visible than in process: a crash shows only if the listener
stops answering or the process dies (the worker's log has the rest), leaked leases
as the ``status`` op's ``num_leases`` above what it was before, and neither staged
inbox blocks (well-formed pushes stay staged until the worker's lease TTL) nor the
server's threads. Liveness is a fresh handshake and ``status``. Point it at a test
cluster: its pushes land in the decode's inbox and its releases end nothing real
(every id it names is its own).
"""

from __future__ import annotations

import ast
import re
import socket
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from pdserve.bench.fuzz.kv_client import Peer
from pdserve.bench.fuzz.kv_inputs import KvSurface
from pdserve.bench.fuzz.kv_mutate import frame
from pdserve.bench.fuzz.kv_watch import Leaks
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.control.auth import authenticate_to_server
from pdserve.kv_transfer.control.channel import LEASE_WAIT_S
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError, check_reply, recv_msg

NUM_BLOCKS = 64  # the remote's block count is not told: pulls name blocks below this
_DIFF = re.compile(r"(\w+): server=(.*?) client=None(?=; \w+: server=|\)$)")


def learn_compat(host: str, port: int, secret: ClusterSecret | None, timeout_s: float = 10.0
                 ) -> dict[str, Any]:
    """The compat the port's hello accepts, read from its refusal of an empty one (the
    refusal names every key with the server's value)."""
    deadline = time.monotonic() + timeout_s
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        if secret is not None:
            authenticate_to_server(sock, secret, deadline, f"{host}:{port}")
        sock.sendall(frame({"op": "hello", "compat": {}}))
        reply = recv_msg(sock) or {}
    found = {key: ast.literal_eval(value)
             for key, value in _DIFF.findall(str(reply.get("error", "")))}
    if not found:
        raise TransferError(f"KV port {host}:{port} did not name its compat: {reply}")
    return found


class RemoteTarget:
    def __init__(self, host: str, port: int, secret: ClusterSecret | None,
                 stall_deadline_s: float) -> None:
        self.label = f"kv {host}:{port}"
        self.peer = Peer(host, port, learn_compat(host, port, secret), secret)
        self.stall_deadline_s = stall_deadline_s
        layout = self.peer.compat.get("layout", {})
        self._num_layers = int(layout.get("num_layers", 1))
        itemsize = getattr(torch, str(layout.get("dtype", "float32"))).itemsize
        self._block_bytes = int(layout.get("num_outer", 1)) * itemsize * int(
            torch.Size(layout.get("layer_shape", [1])).numel())
        self._leases_before = self._status()["num_leases"]
        self._ended = tuple(f"fz-ended-{time.monotonic_ns()}-{i}" for i in range(8))
        with ThreadPoolExecutor(len(self._ended)) as pool:  # each waits the lease wait
            list(pool.map(self._release, self._ended))

    def _status(self) -> dict[str, Any]:
        return request_once(self.peer.host, self.peer.port, {"op": "status"}, 10.0,
                            self.peer.secret)

    def _release(self, req: str) -> None:
        request_once(self.peer.host, self.peer.port, {"op": "release", "req": req},
                     LEASE_WAIT_S + 10.0, self.peer.secret)

    def surface(self, batch: int) -> KvSurface:
        return KvSurface(self.peer.compat, NUM_BLOCKS, self._num_layers, self._block_bytes,
                         (), self._ended, (), self.peer.secret is not None)

    def after_batch(self, staged: Sequence[str]) -> None:
        return  # the decode's inbox keeps them until its TTL

    def crashes(self) -> list[str]:
        return []  # only the listener's answer shows one (the driver checks it)

    def alive(self) -> bool:
        try:
            self._status()
        except TransferError:
            return False
        return True

    def settle(self, staged: Sequence[str], timeout_s: float) -> Leaks:
        time.sleep(min(timeout_s, 1.0))
        return Leaks(max(0, self._status()["num_leases"] - self._leases_before), None, None)

    def liveness(self) -> str:
        try:
            with socket.create_connection((self.peer.host, self.peer.port), 10.0) as sock:
                if self.peer.secret is not None:
                    authenticate_to_server(sock, self.peer.secret, time.monotonic() + 10,
                                           str(self.peer))
                sock.sendall(frame({"op": "hello", "compat": self.peer.compat})
                             + frame({"op": "status"}))
                check_reply(recv_msg(sock), "hello")
                check_reply(recv_msg(sock), "status")
        except (OSError, TransferError) as exc:
            return f"FAILED: {exc}"
        return "hello+status ok"

    def close(self) -> None:
        return
