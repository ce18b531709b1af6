"""The host tier's memory, on the connector's worker side: blocks of the engine's KV
cache copied out to host memory (a save) and back into the cache (a load).

One host tensor per layer, shaped like the layer with ``num_slots`` blocks (pinned when
the cache is on a GPU), allocated once: nothing grows. A save gathers the blocks on the
device (one kernel per layer), then copies each run of consecutive slots in one DMA
into the pinned tier; a load copies each run into a device buffer in one DMA, then
scatters it into the cache on the device. The copies of every layer are queued
without waiting (pinned memory: asynchronous), and the stream is synchronized once.

Each slot remembers the content hash it holds and, with ``checksum``, a checksum of its
bytes; a load whose slot holds another hash, or whose bytes no longer match, raises
``TransferError`` and copies nothing, so vLLM recomputes the blocks. Which slot holds
what is decided by the scheduler side (``TierIndex``); this class only copies and checks.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.integrity import checksum, natural_kind
from pdserve.kv_transfer.layout import KVLayout, block_views, chunk_views


def num_slots(gib: float, block_bytes: int) -> int:
    """How many blocks of ``block_bytes`` (all layers) fit in ``gib``."""
    return int(gib * (1 << 30)) // block_bytes if gib > 0 and block_bytes > 0 else 0


class HostTier:
    def __init__(self, kv: Sequence[torch.Tensor], layout: KVLayout, num_slots: int,
                 verify: bool) -> None:
        self._kv = list(kv)
        self._layout = layout
        self._dims = [layer.block_dim for layer in layout.layers]
        pin = self._pinned = layout.device == "cuda"
        self._host = [
            torch.empty(_with_blocks(t.shape, d, num_slots), dtype=t.dtype, pin_memory=pin)
            for t, d in zip(self._kv, self._dims, strict=True)]
        self._hash: list[bytes | None] = [None] * num_slots
        self._sum: list[int | None] = [None] * num_slots
        self._slot_of: dict[bytes, int] = {}  # hash -> slot, for peers' pool pulls
        self._gen = [0] * num_slots  # bumped whenever a slot is rewritten
        self._verify = verify
        self._kind = natural_kind(self._host)
        self._lock = threading.Lock()  # slots' names; copies run on the pull pool
        self.block_bytes = sum(h.select(d, 0).nbytes for h, d in zip(self._host, self._dims,
                                                                     strict=True))

    @property
    def num_slots(self) -> int:
        return len(self._hash)

    def save(self, block_ids: Sequence[int], slots: Sequence[int],
             hashes: Sequence[bytes]) -> int:
        """Copy the cache's ``block_ids`` into ``slots``, naming each by its hash; the
        bytes copied. The blocks must stay unwritten until this returns."""
        with self._lock:
            for slot in slots:
                old = self._hash[slot]
                if old is not None and self._slot_of.get(old) == slot:
                    del self._slot_of[old]
                self._hash[slot] = None  # unreadable while it is rewritten
                self._gen[slot] += 1
        src = _index(block_ids, self._kv[0])
        runs = _runs(slots)
        gathered = []  # kept until the copies are done
        for kv, host, dim in zip(self._kv, self._host, self._dims, strict=True):
            gathered.append(g := kv.index_select(dim, src))  # one gather on the device
            for stage, into in _run_pieces(g, host, dim, runs):
                into.copy_(stage, non_blocking=self._pinned)  # one DMA per run and piece
        self._synchronize()
        sums = [self._checksum(slot) for slot in slots] if self._verify else [None] * len(slots)
        with self._lock:
            for slot, h, s in zip(slots, hashes, sums, strict=True):
                self._hash[slot], self._sum[slot] = h, s
                self._slot_of[h] = slot
        return len(slots) * self.block_bytes

    def serve(self, hashes: Sequence[bytes]) -> tuple[list[torch.Tensor],
                                                      list[list[torch.Tensor]],
                                                      Callable[[], bool]]:
        """A peer's pool pull: every layer's bytes of the slots holding ``hashes``, in
        the order a pull of single-block runs reads them; the same slots as blocks
        (each its layers' views, what a codec encodes); and a check to call once
        they are sent (False: a slot was rewritten meanwhile, the bytes are not
        those blocks). Raises ``TransferError`` if a block is not held (or, when
        verifying, its bytes no longer match its checksum)."""
        with self._lock:
            slots = [self._slot_of.get(h) for h in hashes]
            missing = sum(slot is None for slot in slots)
            if missing:
                raise TransferError(f"{missing} of {len(hashes)} blocks not in the host tier")
            held = [s for s in slots if s is not None]
            gens = [self._gen[s] for s in held]
            sums = [self._sum[s] for s in held]
        if self._verify:
            for slot, want in zip(held, sums, strict=True):
                if want is not None and self._checksum(slot) != want:
                    raise TransferError(f"host tier slot {slot}: checksum mismatch")
        chunks = list(chunk_views(self._host, self._layout, [(s, 1) for s in held]))
        blocks = [block_views(self._host, self._layout, s) for s in held]

        def unchanged() -> bool:
            with self._lock:
                return all(self._gen[s] == g for s, g in zip(held, gens, strict=True))

        return chunks, blocks, unchanged

    def load(self, slots: Sequence[int], block_ids: Sequence[int],
             hashes: Sequence[bytes]) -> int:
        """Copy ``slots`` into the cache's ``block_ids``; the bytes copied. Raises
        ``TransferError`` (nothing copied) if a slot no longer holds its hash or, when
        verifying, its bytes changed."""
        with self._lock:
            held = [self._hash[slot] for slot in slots]
            sums = [self._sum[slot] for slot in slots]
        for slot, h, want in zip(slots, hashes, held, strict=True):
            if h != want:
                raise TransferError(f"host tier slot {slot} holds another block")
        if self._verify:
            for slot, want_sum in zip(slots, sums, strict=True):
                if want_sum is not None and self._checksum(slot) != want_sum:
                    raise TransferError(f"host tier slot {slot}: checksum mismatch")
        dst = _index(block_ids, self._kv[0])
        runs = _runs(slots)
        staged = []  # kept until the copies are done
        for kv, host, dim in zip(self._kv, self._host, self._dims, strict=True):
            stage = torch.empty(_with_blocks(kv.shape, dim, len(slots)), dtype=kv.dtype,
                                device=kv.device)
            for into, run in _run_pieces(stage, host, dim, runs):
                into.copy_(run, non_blocking=self._pinned)  # one DMA per run and piece
            kv.index_copy_(dim, dst, stage)  # one scatter on the device
            staged.append(stage)
        self._synchronize()  # done means written, as the other loads
        return len(slots) * self.block_bytes

    def _synchronize(self) -> None:
        if self._kv[0].device.type == "cuda":
            torch.cuda.current_stream(self._kv[0].device).synchronize()

    def _checksum(self, slot: int) -> int:
        # Contiguous pieces (a slot of a CUDA layout, blocks in dim 1, is two per layer).
        return checksum(list(chunk_views(self._host, self._layout, [(slot, 1)])), self._kind)


def _with_blocks(shape: torch.Size, dim: int, n: int) -> tuple[int, ...]:
    return (*shape[:dim], n, *shape[dim + 1:])


def _index(ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=like.device)


def _runs(slots: Sequence[int]) -> list[tuple[int, int, int]]:
    """``slots`` as runs of consecutive slots: (first slot, its index in ``slots``, length)."""
    runs: list[tuple[int, int, int]] = []
    for i, slot in enumerate(slots):
        if runs and runs[-1][0] + runs[-1][2] == slot:
            first, at, n = runs[-1]
            runs[-1] = (first, at, n + 1)
        else:
            runs.append((slot, i, 1))
    return runs


def _run_pieces(packed: torch.Tensor, host: torch.Tensor, dim: int,
                runs: Sequence[tuple[int, int, int]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(a piece of ``packed``, the host tier's piece it maps to): for each run, the run's
    blocks in ``packed`` (the blocks in ``slots`` order along ``dim``) and in ``host``
    (at the run's slots), one contiguous pair per index of the dims before ``dim`` (a
    CUDA layout, blocks in dim 1, has two: K and V). Contiguous on both sides, so each
    pair is one copy at the link's speed (a strided copy between devices is staged)."""
    for lead in itertools.product(*(range(n) for n in host.shape[:dim])):
        p, h = packed[lead], host[lead]
        for first, at, n in runs:
            yield p.narrow(0, at, n), h.narrow(0, first, n)
