"""Decode side of layer-wise push: a bounded inbox of pushed KV blocks.

A prefill pushes each layer's blocks as soon as its forward pass has written
them, before the router has even sent the request to this decode (the decode
request carries the prefill's first token, known only when prefill ends). So
pushed blocks land here, in staging buffers keyed by transfer id, and the
decode's load copies them into the blocks vLLM allocated, layer by layer as
each layer is complete. On GPU the staging copy is host → device per layer.

Ownership: an entry is created by the first push of its transfer and removed
by ``take`` (the load consumed it, or gave up), ``fail`` or expiry; memory is
bounded by ``capacity_bytes`` (a push over it is refused and the decode pulls).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.integrity import checksum
from pdserve.kv_transfer.layout import KVLayout, as_bytes, paired_runs


@dataclass
class _Entry:
    staging: list[torch.Tensor]  # per layer: (num_outer, num_blocks, *block_shape)
    arrived: list[bytearray]  # per layer: 1 where a position has arrived
    final: bytearray  # per layer: 1 once the push of the prompt's last tokens arrived
    nbytes: int
    expires: float  # time.monotonic()
    error: str | None = None


class PushInbox:
    def __init__(self, layout: KVLayout, capacity_bytes: int, ttl_s: float) -> None:
        self._layout = layout
        self._capacity = capacity_bytes
        self._ttl_s = ttl_s
        self._entries: dict[str, _Entry] = {}
        # Transfers that failed before an entry existed (refused, aborted): why, expiry.
        self._failed: dict[str, tuple[str, float]] = {}
        self._used = 0
        self._cond = threading.Condition()
        self._pin = torch.cuda.is_available() and layout.device == "cuda"

    @property
    def num_bytes(self) -> int:
        """Bytes staged for transfers not yet consumed (at most ``capacity_bytes``)."""
        with self._cond:
            return self._used

    @property
    def num_layers(self) -> int:
        return len(self._layout.layers)

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def payload_bytes(self, layer: int, count: int) -> int:
        """The bytes a push of ``count`` blocks of ``layer`` carries (every outer chunk)."""
        lay = self._layout.layers[layer]
        per_block = lay.num_outer * torch.Size(lay.shape[lay.block_dim + 1:]).numel()
        return count * per_block * getattr(torch, lay.dtype).itemsize

    def receive_views(
        self, transfer_id: str, layer: int, first: int, count: int, num_blocks: int
    ) -> list[memoryview]:
        """Where to write ``count`` pushed blocks of ``layer`` (one view per outer
        chunk), creating the entry on first use. Raises TransferError if full."""
        if not 0 <= layer < len(self._layout.layers) or not 0 <= first <= first + count \
                <= num_blocks:
            raise TransferError(f"push of layer {layer} blocks {first}+{count}/{num_blocks} "
                                "does not fit this layout")
        with self._cond:
            self._expire_locked()
            if transfer_id in self._failed:
                raise TransferError(self._failed[transfer_id][0])
            entry = self._entries.get(transfer_id) or self._create_locked(transfer_id, num_blocks)
            if entry.error is not None:
                raise TransferError(entry.error)
            staging = entry.staging[layer]
            if staging.shape[1] != num_blocks:
                raise TransferError(f"transfer {transfer_id}: {num_blocks} blocks, "
                                    f"{staging.shape[1]} before")
        return [as_bytes(staging[o, first:first + count]) for o in range(staging.shape[0])]

    def commit(
        self, transfer_id: str, layer: int, first: int, count: int, final: bool,
        crc32: int | None = None,
    ) -> None:
        """Mark blocks received; a checksum mismatch fails the whole transfer."""
        with self._cond:
            entry = self._entries.get(transfer_id)
            if entry is None:
                raise TransferError(f"transfer {transfer_id} is gone (expired or consumed)")
            if crc32 is not None:
                staging = entry.staging[layer]
                # The sender's CRC covers exactly these views, in this order.
                got = checksum([staging[o, first:first + count] for o in range(staging.shape[0])],
                               "crc32")
                if got != crc32:
                    entry.error = (f"checksum mismatch in pushed layer {layer}: "
                                   f"sent {crc32:#010x}, received {got:#010x}")
                    self._cond.notify_all()
                    raise TransferError(entry.error)
            entry.arrived[layer][first:first + count] = b"\x01" * count
            if final:
                entry.final[layer] = 1
            self._cond.notify_all()

    def expire(self) -> None:
        """Drop entries whose decode request never came."""
        with self._cond:
            self._expire_locked()

    def fail(self, transfer_id: str, why: str) -> None:
        with self._cond:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                entry.error = why
            else:
                self._failed[transfer_id] = (why, time.monotonic() + self._ttl_s)
            self._cond.notify_all()

    def load(
        self,
        transfer_id: str,
        kv_caches: Sequence[torch.Tensor],
        first_position: int,
        dst_block_ids: Sequence[int],
        deadline: float,
    ) -> int:
        """Copy positions ``first_position …`` into ``dst_block_ids``, each layer as
        soon as it is complete; always removes the entry. Returns bytes copied."""
        try:
            return self._load(transfer_id, kv_caches, first_position, dst_block_ids, deadline)
        finally:
            self._remove(transfer_id)

    def _load(
        self, transfer_id: str, kv_caches: Sequence[torch.Tensor], first_position: int,
        dst_block_ids: Sequence[int], deadline: float,
    ) -> int:
        count = len(dst_block_ids)
        runs = paired_runs(range(first_position, first_position + count), dst_block_ids)
        copied = 0
        for layer, (tensor, lay) in enumerate(zip(kv_caches, self._layout.layers, strict=True)):
            staging = self._wait_layer(transfer_id, layer, first_position, count, deadline)
            outer = tensor.reshape(lay.num_outer, *tensor.shape[lay.block_dim:])
            for src, dst, n in runs:
                outer[:, dst:dst + n].copy_(staging[:, src:src + n], non_blocking=self._pin)
                copied += staging[:, src:src + n].numel() * staging.element_size()
        if self._pin:
            torch.cuda.current_stream().synchronize()
        return copied

    def _wait_layer(
        self, transfer_id: str, layer: int, first: int, count: int, deadline: float
    ) -> torch.Tensor:
        want = b"\x01" * count
        with self._cond:
            while True:
                entry = self._entries.get(transfer_id)
                if entry is not None and entry.error is not None:
                    raise TransferError(entry.error)
                if transfer_id in self._failed:
                    raise TransferError(self._failed.pop(transfer_id)[0])
                if entry is not None and entry.final[layer] \
                        and entry.arrived[layer][first:first + count] == want:
                    return entry.staging[layer]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    what = "nothing" if entry is None else f"layer {layer} incomplete"
                    raise TransferError(f"push of {transfer_id} not complete in time ({what})")
                self._cond.wait(remaining)

    def _create_locked(self, transfer_id: str, num_blocks: int) -> _Entry:
        shapes = [(lay.num_outer, num_blocks, *lay.shape[lay.block_dim + 1:])
                  for lay in self._layout.layers]
        dtype = getattr(torch, self._layout.layers[0].dtype)
        nbytes = sum(torch.Size(s).numel() for s in shapes) * dtype.itemsize
        if self._used + nbytes > self._capacity:
            why = (f"push inbox full ({self._used} of {self._capacity} bytes used, "
                   f"{nbytes} more asked)")
            self._failed[transfer_id] = (why, time.monotonic() + self._ttl_s)
            self._cond.notify_all()
            raise TransferError(why)
        staging = [torch.empty(s, dtype=dtype, pin_memory=self._pin) for s in shapes]
        entry = _Entry(staging, [bytearray(num_blocks) for _ in shapes],
                       bytearray(len(shapes)), nbytes, time.monotonic() + self._ttl_s)
        self._entries[transfer_id] = entry
        self._used += nbytes
        return entry

    def drop(self, transfer_id: str) -> None:
        """Free a transfer no load will take (the decode needed none of it); later
        pushes of it are refused. One step: a push in between would stage it again."""
        with self._cond:  # reentrant: _remove takes it too
            self._remove(transfer_id)
            self._failed[transfer_id] = ("dropped by the decode", time.monotonic() + self._ttl_s)

    def _remove(self, transfer_id: str) -> None:
        with self._cond:
            entry = self._entries.pop(transfer_id, None)
            if entry is not None:
                self._used -= entry.nbytes

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for tid in [t for t, e in self._entries.items() if e.expires < now]:
            self._used -= self._entries.pop(tid).nbytes
        for tid in [t for t, (_, expires) in self._failed.items() if expires < now]:
            del self._failed[tid]
