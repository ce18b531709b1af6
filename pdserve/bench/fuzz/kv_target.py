"""The fuzzer's default target: a live tcp transport on fake KV tensors in this process,
serving pulls (leases), pushes (an inbox) and pool pulls (a fake host tier), as a
worker's does; optionally with a cluster secret.

In process, everything the fuzz must not break is visible: a server thread that died
(``threading.excepthook``) or whose handler failed unexpectedly (the control server
logs it), the serving threads (back to their baseline once the fuzz ends), leases
stuck in transfer (nothing else survives its expiry), staged inbox bytes no accepted
push owns, pool serves never finished; and afterwards a real pull and push must move
the right bytes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.bench.fuzz.kv_client import Peer
from pdserve.bench.fuzz.kv_inputs import KvSurface
from pdserve.bench.fuzz.kv_live import pull_and_push
from pdserve.bench.fuzz.kv_watch import CrashWatch, Leaks, wait_threads
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.base import TransportOptions, create_transport
from pdserve.kv_transfer.control.auth import AUTH_TIMEOUT_S
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import PROTOCOL_VERSION, TransferError
from pdserve.kv_transfer.layout import KVLayout, chunk_views
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.push.inbox import PushInbox

NUM_BLOCKS = 32
NUM_LAYERS = 4
BLOCK_SIZE = 16
LAYER_SHAPE = (NUM_BLOCKS, 2, BLOCK_SIZE, 8)  # vLLM's CPU layout: (blocks, heads, block, 2*hd)
BAIT_LEASES = 8  # leases fresh in every batch, for the fuzz's pulls to find
ENDED = tuple(f"fz-ended-{i}" for i in range(16))  # requests whose lease ended
INBOX_BYTES = 4 << 20
LIVENESS_S = 10.0


def fake_caches(seed: int) -> dict[str, torch.Tensor]:
    """Random KV in vLLM's CPU layout, every layer a view into one buffer (as vLLM's)."""
    gen = torch.Generator().manual_seed(seed)
    buf = torch.randn((NUM_LAYERS, *LAYER_SHAPE), generator=gen)
    return {f"layer.{i}": buf[i] for i in range(NUM_LAYERS)}


class FakePool:
    """A host tier that holds a few blocks by hash: serves them and counts serves that
    were never finished (each would pin its slots forever)."""

    def __init__(self, caches: list[torch.Tensor], layout: KVLayout) -> None:
        self.hashes = {bytes([i]) * 32: i for i in range(1, 5)}  # hash -> block id
        self._kv, self._layout = caches, layout
        self._lock = threading.Lock()
        self.num_open = 0

    def __call__(self, hashes: list[bytes]) -> _Serve:
        missing = [h for h in hashes if h not in self.hashes]
        if missing or not hashes:
            raise TransferError(f"{len(missing)} of {len(hashes)} blocks not held")
        runs = [(self.hashes[h], 1) for h in hashes]
        with self._lock:
            self.num_open += 1
        return _Serve(self, list(chunk_views(self._kv, self._layout, runs)))

    def closed(self) -> None:
        with self._lock:
            self.num_open -= 1


class _Serve:
    def __init__(self, pool: FakePool, chunks: list[torch.Tensor]) -> None:
        self.chunks, self._pool, self._done = chunks, pool, False

    def unchanged(self) -> bool:
        return True

    def finish(self, ok: bool) -> None:
        if not self._done:
            self._done = True
            self._pool.closed()


class InProcessTarget:
    """A tcp transport on 127.0.0.1 (its own port) with ``secret`` (None: open), closing
    stalled connections after ``idle_timeout_s``."""

    def __init__(self, label: str, secret: ClusterSecret | None, idle_timeout_s: float,
                 seed: int = 0) -> None:
        self.label = label
        self._offset = 0.0  # the lease clock runs ahead by this much at the end
        self.leases = LeaseTable(clock=lambda: time.time() + self._offset)
        caches = fake_caches(seed)
        self._kv = list(caches.values())
        self.layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, BLOCK_SIZE)
        self.inbox = PushInbox(self.layout, INBOX_BYTES, ttl_s=300.0)
        self.pool = FakePool(self._kv, self.layout)
        self.options = TransportOptions(secret=secret, idle_timeout_s=idle_timeout_s)
        self.compat: dict[str, Any] = {"model": "fuzz", "dtype": "float32",
                                       "block_size": BLOCK_SIZE, "tp_size": 1,
                                       "layout": self.layout.describe()}
        self.watch = CrashWatch()
        self._quiet = _quiet_transport_logs()
        self.baseline_threads = wait_threads(0, 2.0)  # an earlier server's may still end
        self.transport = create_transport("tcp", self.options)
        channel = self.transport.push_channel()
        assert channel is not None  # tcp pushes
        channel.accept_pushes(self.inbox)
        self.transport.serve_pool(self.pool)
        port = self.transport.start(kv_caches=self._kv, layout=self.layout, leases=self.leases,
                                    compat=self.compat, host="127.0.0.1", port=0)
        # A stall inside the challenge is dropped by the challenge's own deadline.
        self.stall_deadline_s = max(idle_timeout_s, AUTH_TIMEOUT_S if secret else 0.0)
        self.peer = Peer("127.0.0.1", port, self._full_compat(), secret)
        for req in ENDED:
            self.leases.finish(req)  # ended before it arrived: later pulls refused at once

    def _full_compat(self) -> dict[str, Any]:
        """The compat a hello must carry: the server adds its transport and version."""
        return dict(self.compat, protocol_version=PROTOCOL_VERSION, transport="tcp")

    def surface(self, batch: int) -> KvSurface:
        """Fresh bait leases for this batch's pulls (earlier ones expire at the end)."""
        live = tuple(f"bait-{batch}-{i}" for i in range(BAIT_LEASES))
        for i, req in enumerate(live):
            first = (batch + 3 * i) % (NUM_BLOCKS - 4)
            self.leases.add(req, range(first, first + 1 + i % 4), time.time() + 300)
        return KvSurface(self.peer.compat, NUM_BLOCKS, NUM_LAYERS, self.block_bytes, live,
                         ENDED, tuple(h.hex() for h in self.pool.hashes),
                         self.peer.secret is not None)

    @property
    def block_bytes(self) -> int:
        return self.inbox.payload_bytes(0, 1)

    def after_batch(self, staged: Sequence[str]) -> None:
        """The decode would take or drop what was pushed: drop it (keeps the inbox from
        filling up, so later pushes reach it)."""
        for xfer in staged:
            self.inbox.drop(xfer)

    def crashes(self) -> list[str]:
        return self.watch.events()

    def alive(self) -> bool:
        try:
            request_once(self.peer.host, self.peer.port, {"op": "status"}, 5.0,
                         self.peer.secret)
        except TransferError:
            return False
        return True

    def settle(self, staged: Sequence[str], timeout_s: float) -> Leaks:
        """Once every serving thread is back: what the fuzz left held."""
        after = wait_threads(self.baseline_threads, timeout_s)
        self.after_batch(staged)
        self._offset = 1e7  # every lease is past its deadline: only one in transfer stays
        self.leases.expire()
        self.leases.take_done()
        held = self.leases.num_held
        self._offset = 0.0
        unit = self.block_bytes * NUM_LAYERS  # one block of every layer
        blocks = -(-self.inbox.num_bytes // unit)
        return Leaks(held + self.pool.num_open, blocks, (self.baseline_threads, after))

    def liveness(self) -> str:
        """A real pull and a real push from another transport, bytes compared."""
        return pull_and_push(self.peer, self.options, self.layout, self._kv, self.leases,
                             self.inbox, LIVENESS_S)

    def close(self) -> None:
        self.transport.close()
        self.watch.close()
        self._quiet()


def _quiet_transport_logs() -> Any:
    """The transport warns of every send a fuzzed client abandoned: keep only errors
    (the crash watch reads those); returns what restores the level."""
    log = logging.getLogger("pdserve.kv_transfer")
    level = log.level
    log.setLevel(logging.ERROR)
    return lambda: log.setLevel(level)
