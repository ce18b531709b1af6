"""The connector's worker side (runs in vLLM's Worker process, beside the KV).

Network work runs on the transport's threads and a small pull pool; the
engine's main thread only submits jobs and polls futures (no busy-spinning, no
waiting inside a step, thread affinity untouched).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from pdserve.kv_transfer.base import KVTransport, PeerAddress, create_transport
from pdserve.kv_transfer.cache_io import CacheIO
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.metadata import (
    NO_COPY,
    KVHandle,
    LoadSpec,
    PdserveConnectorMetadata,
    StoreFeedback,
)
from pdserve.kv_transfer.push.inbox import PushInbox
from pdserve.kv_transfer.push.sender import PushSender
from pdserve.kv_transfer.remote.compression import codec_for
from pdserve.kv_transfer.remote.plan import COUNTS as STORE_COUNTS
from pdserve.kv_transfer.remote.worker import StoreWorker
from pdserve.kv_transfer.step_model import StepTimer
from pdserve.kv_transfer.threads import unpin_current_thread
from pdserve.kv_transfer.tiers.store import TierStore

logger = logging.getLogger("pdserve.kv_transfer.worker")

def pool_transport_ok(transport: str, device: str) -> bool:
    """Whether the cluster KV pool can move host-tier blocks on ``transport``: not over
    NCCL (torch on a GPU), which sends device memory only."""
    return not (transport == "torch" and device == "cuda")


# Longest an idle engine step waits for a transfer to end (bounds the delay a new
# request can see while the engine holds or loads KV and has nothing else to do).
IDLE_WAIT_S = 0.02


class WorkerSide:
    def __init__(
        self, config: ConnectorConfig, compat: dict[str, Any], tp_rank: int, block_size: int,
        num_blocks: int, tier_slots: int = 0, disk_slots: int = 0, disk_compat: str = "",
        store: Callable[[list[torch.Tensor], KVLayout], StoreWorker | None] | None = None,
    ) -> None:
        self._config = config
        self._make_store = store  # the cluster KV store's side, once the caches exist
        self._tier_slots = tier_slots
        self._disk_slots = disk_slots
        self._disk_compat = disk_compat
        self._saves: dict[str, Future[int]] = {}
        # Requests whose blocks are both leased and saved: finished when both are.
        self._parts: dict[str, int] = {}
        self._compat = compat
        self._tp_rank = tp_rank
        self._block_size = block_size
        self._num_blocks = num_blocks
        self._transport: KVTransport = create_transport(
            config.transport, config.transport_options())
        if config.kv_tls() is not None and config.transport != "tcp":
            logger.warning("KV TLS covers the %s transport's control channel only: its KV "
                           "bytes travel unencrypted (--transport tcp encrypts them; "
                           "--require-tls refuses this)", config.transport)
        # Set whenever a transfer ends (a lease ends, a pull finishes).
        self._progress = threading.Event()
        self._idle = False
        self._leases = LeaseTable(on_end=self._progress.set)
        self._pool = ThreadPoolExecutor(
            max_workers=config.pull_threads, thread_name_prefix="pdserve-kv-pull",
            initializer=unpin_current_thread,
        )
        self._pulls: dict[str, Future[int]] = {}
        self._last_stats: dict[str, int] = {}
        self._kv: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._inbox: PushInbox | None = None
        self._sender: PushSender | None = None
        # Decode-side load counters: the load is what a decode request waits for. The
        # pool's loads, and the scheduler side's tier counts (which come with the steps).
        self._load_stats = dict.fromkeys(
            ("loads", "load_time_ns", "push_loads", "push_fallbacks", "pool_loads",
             "pool_load_blocks", "pool_load_time_ns", "pool_load_failures", "pool_load_bytes",
             "pool_load_refusals",
             "tier_miss_blocks", "tier_evictions", "disk_evictions", *STORE_COUNTS), 0)
        self._load_lock = threading.Lock()
        # The tiers, the store and the pool (set up once the KV caches are registered).
        self._io = CacheIO(config, tp_rank, self._transport, self._count_load)
        self.steps = StepTimer()  # the engine's step times (the status op shows the fit)
        self.port = 0  # the KV endpoint's port, once registered

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = KVLayout.from_kv_caches(kv_caches, self._num_blocks, self._block_size)
        compat = dict(self._compat, layout=layout.describe())
        port = self._config.kv_port + self._tp_rank if self._config.kv_port else 0
        self._kv = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        # The pool's blocks, pulled and served, in --kv-compression's encoding.
        self._transport.use_pool_codec(codec_for(self._config.kv_compression, layout))
        if self._tier_slots or self._disk_slots:
            self._io.tiers = tiers = TierStore(
                self._kv, layout, self._tier_slots, self._config.kv_checksum,
                self._config.kv_disk_dir if self._disk_slots else None, self._disk_compat)
            logger.info("KV tiers: host %d blocks, disk %d blocks%s", self._tier_slots,
                        self._disk_slots, f" in {tiers.disk.folder}"
                        if tiers.disk is not None else "")
            if tiers.host is not None and pool_transport_ok(
                    self._config.transport, layout.device):  # peers may pull from it: the pool
                self._transport.serve_pool(tiers.serve)
        if self._make_store is not None:
            self._io.store = self._make_store(self._kv, layout)
            self._io.tell_store_off = self._io.store is None
        self._transport.add_status(self._status)
        channel = self._transport.push_channel()
        if channel is not None:
            # The sender idles until a request's params ask for a push; the inbox
            # holds memory, so it exists only where push is on.
            self._sender = PushSender(channel, self._tp_rank, self._config.transfer_timeout_s,
                                      self._config.kv_checksum)
            if self._config.push:
                self._inbox = PushInbox(layout, self._config.push_inbox_mib << 20,
                                        self._config.lease_s)
                channel.accept_pushes(self._inbox)
        self.port = bound = self._transport.start(
            kv_caches=list(kv_caches.values()),
            layout=layout,
            leases=self._leases,
            compat=compat,
            host=self._config.kv_bind_host,
            port=port,
        )
        logger.info(
            "pdserve KV endpoint %s on %s:%d (%d layers, layout %s)",
            self._config.transport, self._config.kv_bind_host, bound, len(layout.layers),
            layout.describe(),
        )

    def begin_forward(self, meta: PdserveConnectorMetadata) -> None:
        """The engine binds this step's metadata: its forward pass starts."""
        if not meta.idle:
            self.steps.begin(meta.num_decode_seqs, meta.num_prefill_tokens)

    def start_step(self, meta: PdserveConnectorMetadata) -> None:
        self._idle = meta.idle
        for req_id, lease in meta.leases.items():
            self._leases.add(req_id, lease.block_ids, lease.deadline)
        for req_id, load in meta.loads.items():
            future = self._pool.submit(self._load, req_id, load)
            future.add_done_callback(lambda _: self._progress.set())
            self._pulls[req_id] = future
        self._start_tiers(meta)
        for handle in meta.releases:
            if handle.pushed and self._inbox is not None:
                self._inbox.drop(handle.transfer_id)
            self._pool.submit(self._release, handle)
        if meta.push_cancels and self._sender is not None:
            self._sender.cancel(meta.push_cancels)

    def save_layer(self, layer_name: str, meta: PdserveConnectorMetadata) -> None:
        """Push this layer of every request this step computes for a remote decode."""
        if meta.pushes and self._sender is not None:
            layer = self._layer_index[layer_name]
            self._sender.submit(meta.pushes, layer, self._kv[layer].device)

    def poll(self) -> tuple[set[str], set[str], set[str]]:
        """(finished_sending, finished_recving, failed_recving) since the last poll.

        While nothing is scheduled, vLLM steps in a tight loop only to learn when
        transfers end (≈1.4 cores on CPU), starving the very threads doing the
        transfer. On such idle steps, wait up to ``IDLE_WAIT_S`` for one to end.
        """
        self._progress.clear()
        self._leases.expire()
        if self._inbox is not None:
            self._inbox.expire()
        busy = self._leases.num_held or self._pulls or self._saves
        ready = (self._leases.has_done or any(f.done() for f in self._pulls.values())
                 or any(f.done() for f in self._saves.values()))
        if self._idle and busy and not ready:
            self._progress.wait(IDLE_WAIT_S)
        sending = self._finished_sending()
        recving: set[str] = set()
        failed: set[str] = set()
        for req_id in [r for r, f in self._pulls.items() if f.done()]:
            future = self._pulls.pop(req_id)
            recving.add(req_id)
            if future.exception() is not None:
                failed.add(req_id)  # vLLM recomputes the whole request
            self._io.loaded(req_id, req_id in failed)
        return sending, recving, failed

    def _finished_sending(self) -> set[str]:
        """Requests whose blocks nothing reads any more: lease ended, save done (both,
        for a request that has both)."""
        ended = list(self._leases.take_done())
        for req_id in [r for r, f in self._saves.items() if f.done()]:
            self._saves.pop(req_id)
            ended.append(req_id)
        sending = set()
        for req_id in ended:
            left = self._parts.pop(req_id, 1) - 1
            if left:
                self._parts[req_id] = left
            else:
                sending.add(req_id)
        return sending

    def _start_tiers(self, meta: PdserveConnectorMetadata) -> None:
        if meta.tier_counts and self._tp_rank == 0:  # one count per engine, not per rank
            self._count_load(**meta.tier_counts)
        for req_id in meta.tier_saves.keys() | meta.store_saves.keys():
            if req_id in meta.leases:
                self._parts[req_id] = 2
            future = self._pool.submit(self._io.save, req_id, meta.tier_saves.get(req_id),
                                       meta.disk_saves.get(req_id, NO_COPY),
                                       meta.store_saves.get(req_id))
            future.add_done_callback(lambda _: self._progress.set())
            self._saves[req_id] = future
        for req_id in meta.tier_loads.keys() | meta.pool_loads.keys() | meta.store_loads.keys():
            future = self._pool.submit(self._io.load, req_id, meta.tier_loads.get(req_id),
                                       meta.disk_loads.get(req_id, NO_COPY),
                                       meta.pool_loads.get(req_id), meta.store_loads.get(req_id))
            future.add_done_callback(lambda _: self._progress.set())
            self._pulls[req_id] = future

    def take_load_errors(self) -> set[int]:
        return self._io.take_load_errors()

    def feedback(self) -> StoreFeedback | None:
        return self._io.feedback(self.steps)

    def stats_delta(self) -> dict[str, int] | None:
        now = dict(self._transport.stats(), leases_expired=self._leases.num_expired,
                   **self._status_extra())
        for gauge in ("inflight_pulls", "push_inbox_bytes"):  # not counters
            now.pop(gauge, None)
        delta = {k: v - self._last_stats.get(k, 0) for k, v in now.items()}
        self._last_stats = now
        return delta if any(delta.values()) else None

    def _status(self) -> dict[str, int]:
        """The status op's extra fields: load counters and the step-time fit."""
        return dict(self._status_extra(), **self.steps.estimate().to_status())

    def _status_extra(self) -> dict[str, int]:
        with self._load_lock:
            out = dict(self._load_stats)
        out.update(self._io.stats())
        if self._sender is not None:
            out.update(layers_pushed=self._sender.num_layers_pushed,
                       pushes_failed=self._sender.num_pushes_failed)
        if self._inbox is not None:
            out.update(push_inbox_bytes=self._inbox.num_bytes)
        return out

    def _count_load(self, **deltas: int) -> None:
        with self._load_lock:
            for key, value in deltas.items():
                self._load_stats[key] += value

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._io.close()
        if self._sender is not None:
            self._sender.close()
        self._transport.close()

    def _peer(self, handle: KVHandle) -> PeerAddress:
        return PeerAddress(handle.host, handle.port + self._tp_rank)

    def _load(self, req_id: str, load: LoadSpec) -> int:
        start = time.perf_counter_ns()
        try:
            return self._pull(req_id, load)
        finally:
            self._count_load(loads=1, load_time_ns=time.perf_counter_ns() - start)

    def _pull(self, req_id: str, load: LoadSpec) -> int:
        deadline = time.monotonic() + self._config.transfer_timeout_s
        handle = load.handle
        if handle.pushed and self._inbox is not None:
            nbytes = self._take_pushed(self._inbox, req_id, load, deadline)
            if nbytes is not None:
                return nbytes
        try:
            nbytes = self._transport.pull(
                self._peer(handle), handle.remote_request_id, load.src_block_ids,
                load.dst_block_ids, deadline,
            )
        except TransferError as exc:
            logger.warning("KV pull for %s from %s failed: %s", req_id, self._peer(handle), exc)
            raise
        logger.debug("pulled %d bytes for %s (transfer %s)", nbytes, req_id, handle.transfer_id)
        return nbytes

    def _take_pushed(self, inbox: PushInbox, req_id: str, load: LoadSpec,
                     deadline: float) -> int | None:
        """Copy pushed KV into our blocks; None if it is not usable (then pull)."""
        wait_until = min(deadline, time.monotonic() + self._config.push_wait_s)
        try:
            nbytes = inbox.load(load.handle.transfer_id, self._kv, load.first_position,
                                      load.dst_block_ids, wait_until)
        except TransferError as exc:
            self._count_load(push_fallbacks=1)
            logger.warning("pushed KV for %s unusable, pulling: %s", req_id, exc)
            return None
        self._count_load(push_loads=1)
        self._pool.submit(self._release, load.handle)  # the prefill's lease ends
        return nbytes

    def _release(self, handle: KVHandle) -> None:
        deadline = time.monotonic() + self._config.transfer_timeout_s
        try:
            self._transport.release(self._peer(handle), handle.remote_request_id, deadline)
        except TransferError as exc:  # the lease expires on its own
            logger.warning("KV release of %s failed: %s", handle.remote_request_id, exc)
