"""The host tier's memory, on the connector's worker side: blocks of the engine's KV
cache copied out to host memory (a save) and back into the cache (a load).

One host tensor per layer, shaped like the layer with ``num_slots`` blocks (pinned when
the cache is on a GPU), allocated once: nothing grows. Each slot remembers the content
hash it holds and, with ``checksum``, a checksum of its bytes; a load whose slot holds
another hash, or whose bytes no longer match, raises ``TransferError`` and copies
nothing, so vLLM recomputes the blocks. Which slot holds what is decided by the
scheduler side (``TierIndex``); this class only copies and checks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

from pdserve.kv_transfer.integrity import checksum, natural_kind
from pdserve.kv_transfer.layout import KVLayout, chunk_views
from pdserve.kv_transfer.wire import TransferError


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
        src, dst = _index(block_ids, self._kv[0]), _index(slots, self._host[0])
        if self._pinned:  # gather on the device, one DMA each into pinned staging
            staged = []
            for kv, dim in zip(self._kv, self._dims, strict=True):
                gathered = kv.index_select(dim, src)
                stage = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                staged.append(stage.copy_(gathered, non_blocking=True))
            torch.cuda.current_stream(self._kv[0].device).synchronize()
            for host, stage, dim in zip(self._host, staged, self._dims, strict=True):
                host.index_copy_(dim, dst, stage)
        else:
            for kv, host, dim in zip(self._kv, self._host, self._dims, strict=True):
                host.index_copy_(dim, dst, kv.index_select(dim, src).to("cpu"))
        sums = [self._checksum(slot) for slot in slots] if self._verify else [None] * len(slots)
        with self._lock:
            for slot, h, s in zip(slots, hashes, sums, strict=True):
                self._hash[slot], self._sum[slot] = h, s
                self._slot_of[h] = slot
        return len(slots) * self.block_bytes

    def serve(self, hashes: Sequence[bytes]) -> tuple[list[torch.Tensor], Callable[[], bool]]:
        """A peer's pool pull: every layer's bytes of the slots holding ``hashes``, in
        the order a pull of single-block runs reads them, and a check to call once
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

        def unchanged() -> bool:
            with self._lock:
                return all(self._gen[s] == g for s, g in zip(held, gens, strict=True))

        return chunks, unchanged

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
            for slot, want in zip(slots, sums, strict=True):
                if want is not None and self._checksum(slot) != want:
                    raise TransferError(f"host tier slot {slot}: checksum mismatch")
        src, dst = _index(slots, self._host[0]), _index(block_ids, self._kv[0])
        staged = []  # pinned: gathered on the host, one DMA each, scattered on the device
        for kv, host, dim in zip(self._kv, self._host, self._dims, strict=True):
            if self._pinned:
                shape = _with_blocks(host.shape, dim, len(slots))
                stage = torch.empty(shape, dtype=host.dtype, pin_memory=True)
                torch.index_select(host, dim, src, out=stage)
                staged.append(stage)
                kv.index_copy_(dim, dst, stage.to(kv.device, non_blocking=True))
            else:
                kv.index_copy_(dim, dst, host.index_select(dim, src).to(kv.device))
        if self._kv[0].device.type == "cuda":  # done means written, as the other loads
            torch.cuda.current_stream(self._kv[0].device).synchronize()
        return len(slots) * self.block_bytes

    def slot_views(self, slot: int) -> list[torch.Tensor]:
        """The slot's bytes in every layer (the checksum's input; tests corrupt them)."""
        return [host.select(dim, slot) for host, dim in zip(self._host, self._dims,
                                                            strict=True)]

    def _checksum(self, slot: int) -> int:
        # Contiguous pieces (a slot of a CUDA layout, blocks in dim 1, is two per layer).
        return checksum(list(chunk_views(self._host, self._layout, [(slot, 1)])), self._kind)


def _with_blocks(shape: torch.Size, dim: int, n: int) -> tuple[int, ...]:
    return (*shape[:dim], n, *shape[dim + 1:])


def _index(ids: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(list(ids), dtype=torch.long, device=like.device)
