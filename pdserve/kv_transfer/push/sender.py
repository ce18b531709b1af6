"""Prefill side of layer-wise push: send each layer's blocks as soon as vLLM
saves that layer, on one background thread (the engine's thread only queues).

A transfer whose push fails (decode unreachable, inbox full) is not pushed any
further and the decode is told (``push_abort``); the prefill still holds the
blocks under its lease, so the decode pulls them instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from pdserve.core.handle import PushTarget
from pdserve.kv_transfer.base import PeerAddress, PushChannel
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.push.spec import PushSpec
from pdserve.kv_transfer.threads import unpin_current_thread

logger = logging.getLogger("pdserve.kv_transfer.push")
# A failed transfer id is remembered this long so its later layers are skipped.
_FAILED_TTL_S = 120.0


@dataclass(frozen=True)
class _Job:
    spec: PushSpec
    layer: int
    ready: torch.cuda.Event | None


@dataclass(frozen=True)
class _Cancel:
    target: PushTarget


class PushSender:
    def __init__(
        self, transport: PushChannel, tp_rank: int, timeout_s: float, checksum: bool
    ) -> None:
        self._transport = transport
        self._tp_rank = tp_rank
        self._timeout_s = timeout_s
        self._checksum = checksum
        self._jobs: queue.SimpleQueue[_Job | _Cancel | None] = queue.SimpleQueue()
        self._failed: dict[str, float] = {}
        self.num_layers_pushed = 0
        self.num_pushes_failed = 0
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-push", daemon=True)
        self._thread.start()

    def submit(self, specs: dict[str, PushSpec], layer: int, device: torch.device) -> None:
        """Queue one layer of every pushed request (called inside the forward pass)."""
        ready = None
        if device.type == "cuda":  # the layer's kernels must finish before we read it
            ready = torch.cuda.Event()
            ready.record()
        for spec in specs.values():
            self._jobs.put(_Job(spec, layer, ready))

    def cancel(self, targets: list[PushTarget]) -> None:
        """Tell decodes to drop pushed KV that no request will take."""
        for target in targets:
            self._jobs.put(_Cancel(target))

    def close(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        unpin_current_thread()
        while (job := self._jobs.get()) is not None:
            if isinstance(job, _Cancel):
                self._give_up(job.target, "the prefill handed no KV over", quiet=True)
                continue
            target = job.spec.target
            if target.transfer_id in self._failed:
                continue
            peer = self._peer(target)
            deadline = time.monotonic() + self._timeout_s
            try:
                if job.ready is not None:
                    job.ready.synchronize()
                self._transport.push(
                    peer, target.transfer_id, job.layer, job.spec.first_position,
                    job.spec.block_ids, job.spec.num_blocks, job.spec.final, deadline,
                    self._checksum,
                )
                self.num_layers_pushed += 1
            except TransferError as exc:
                self._give_up(target, str(exc))

    def _peer(self, target: PushTarget) -> PeerAddress:
        return PeerAddress(target.host, target.port + self._tp_rank)

    def _give_up(self, target: PushTarget, why: str, quiet: bool = False) -> None:
        now = time.monotonic()
        transfer_id, peer = target.transfer_id, self._peer(target)
        self._failed = {t: at for t, at in self._failed.items() if now - at < _FAILED_TTL_S}
        self._failed[transfer_id] = now
        if not quiet:
            self.num_pushes_failed += 1
            logger.warning("KV push of %s to %s failed, decode will pull: %s", transfer_id,
                           peer, why)
        try:
            self._transport.push_abort(peer, transfer_id, why, now + min(self._timeout_s, 2.0))
        except TransferError as exc:
            logger.debug("push abort of %s not delivered: %s", transfer_id, exc)
