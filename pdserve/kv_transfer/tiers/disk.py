"""The disk tier: KV blocks in files under ``--kv-disk-dir``, below the host tier.

The folder holds one sub-folder per model compatibility hash (model, dtype, block size,
TP, bytes per block, and the checkpoint's content: ``fingerprint.py``): files of another
model, or of weights since overwritten under the same path, are never read, and are
reported once at start. Block files are the owner's only (0600, their folder 0700): a
prompt's KV is the prompt. Inside, a fixed number of slot files ``<slot>.kv``
(``--kv-disk-gib`` decides how many), each one block of every layer, so the tier never
grows past its size: a new block overwrites the least recently used slot (written to a
temporary file and renamed, so a reader sees the old block or the new one, never half of
each). A file starts with a header (magic, the block's content hash, the payload's length and
CRC32); a load checks all of it and raises ``TransferError`` for a truncated, corrupt
or re-used file, copying nothing, so vLLM recomputes the blocks.

Which slot holds what is decided by the scheduler side (``TierIndex``), which learns
what survived a restart from ``scan``; this module's ``DiskTier`` (worker side) only
reads and writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout, as_bytes

logger = logging.getLogger("pdserve.kv_transfer.disk")

MAGIC = b"PDKVDSK1"
_HEADER = struct.Struct("<8sH32sQI")  # magic, hash length, hash (padded), payload, crc32


def compat_hash(compat: dict[str, Any]) -> str:
    """The sub-folder of one model's blocks: a hash of what must match to reuse them."""
    return hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]


def scan(root: Path, compat: str, num_slots: int) -> list[tuple[int, bytes]]:
    """What a disk tier folder held at start: the ``(slot, hash)`` of ``root/compat``'s
    slot files, least recently used first. Slots past ``num_slots`` and unreadable files
    are left out (their slots are rewritten); files of another model or layout are
    ignored, with a warning saying how many."""
    folder = root / compat
    foreign = sum(1 for d in root.iterdir() if d.is_dir() and d.name != compat
                  for _ in d.glob("*.kv")) if root.is_dir() else 0
    found = []
    for path in folder.glob("*.kv") if folder.is_dir() else ():
        try:
            slot = int(path.stem)
            if not 0 <= slot < num_slots:
                continue
            with path.open("rb") as f:
                block_hash, _, _ = _parse_header(f.read(_HEADER.size))
            found.append((path.stat().st_mtime_ns, slot, block_hash))
        except (OSError, ValueError, TransferError):
            continue
    if foreign:
        logger.warning("disk tier %s: %d block files of another model or layout ignored",
                       root, foreign)
    return [(slot, h) for _, slot, h in sorted(found)]


def close_block_folders(root: Path) -> None:
    """Make every sub-folder of ``root`` that holds block files (``*.kv``) its owner's
    only: an older pdserve, or other weights, left theirs readable by all (0755 folders
    of 0644 files), and a block is a prompt's KV. ``root`` itself is the operator's
    (it may be a shared folder), so it is left as it is."""
    for folder in root.iterdir():
        try:
            if (folder.is_symlink() or not folder.is_dir()
                    or not folder.stat().st_mode & 0o077 or not any(folder.glob("*.kv"))):
                continue
            os.chmod(folder, 0o700)
        except OSError as exc:
            logger.warning("disk tier %s: cannot close %s to its owner: %s", root, folder,
                           exc.strerror or exc)
            continue
        logger.warning("disk tier %s: %s held block files others could read; now 0700",
                       root, folder.name)


class DiskTier:
    def __init__(self, root: Path, compat: str, kv: Sequence[torch.Tensor],
                 layout: KVLayout) -> None:
        self.folder = root / compat
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.folder.mkdir(exist_ok=True, mode=0o700)
        os.chmod(self.folder, 0o700)  # also a folder an older pdserve left open
        close_block_folders(root)  # and those of other weights beside it
        self._kv = list(kv)
        self._dims = [layer.block_dim for layer in layout.layers]
        self._shapes = [tuple(t.select(d, 0).shape) for t, d in zip(self._kv, self._dims,
                                                                    strict=True)]
        self.block_bytes = sum(t.select(d, 0).nbytes for t, d in zip(self._kv, self._dims,
                                                                     strict=True))

    def path(self, slot: int) -> Path:
        return self.folder / f"{slot}.kv"

    def save(self, block_ids: Sequence[int], slots: Sequence[int],
             hashes: Sequence[bytes]) -> int:
        """Write the cache's ``block_ids`` to ``slots``' files; the bytes written. Raises
        ``OSError`` (a full disk, say); a slot whose write failed holds no file."""
        for block_id, slot, block_hash in zip(block_ids, slots, hashes, strict=True):
            payload = b"".join(
                as_bytes(kv.select(d, block_id).contiguous().cpu())
                for kv, d in zip(self._kv, self._dims, strict=True))
            tmp = self.path(slot).with_suffix(".tmp")
            try:
                with _open_private(tmp) as f:
                    f.write(_header(block_hash, payload))
                    f.write(payload)
                os.replace(tmp, self.path(slot))
            except OSError:
                tmp.unlink(missing_ok=True)
                self.path(slot).unlink(missing_ok=True)
                raise
        return len(slots) * self.block_bytes

    def load(self, slots: Sequence[int], block_ids: Sequence[int],
             hashes: Sequence[bytes]) -> int:
        """Read ``slots``' files into the cache's ``block_ids``; the bytes read. Every
        file is read and checked before any block is written: ``TransferError``
        (nothing written) for a missing, truncated, corrupt or re-used file."""
        payloads = [self._read(slot, h) for slot, h in zip(slots, hashes, strict=True)]
        for block_id, payload in zip(block_ids, payloads, strict=True):
            offset = 0
            for kv, d, shape in zip(self._kv, self._dims, self._shapes, strict=True):
                n = kv.element_size() * _numel(shape)
                src = torch.frombuffer(payload, dtype=kv.dtype, count=n // kv.element_size(),
                                       offset=offset).view(shape)
                kv.select(d, block_id).copy_(src)
                offset += n
        return len(slots) * self.block_bytes

    def _read(self, slot: int, block_hash: bytes) -> bytearray:
        try:
            with self.path(slot).open("rb") as f:
                held, size, crc = _parse_header(f.read(_HEADER.size))
                payload = bytearray(f.read())
        except OSError as exc:
            raise TransferError(f"disk tier slot {slot}: {exc}") from exc
        if held != block_hash:
            raise TransferError(f"disk tier slot {slot} holds another block")
        if len(payload) != size or size != self.block_bytes:
            raise TransferError(f"disk tier slot {slot}: truncated ({len(payload)} of "
                                f"{size} bytes)")
        if zlib.crc32(payload) != crc:
            raise TransferError(f"disk tier slot {slot}: checksum mismatch")
        return payload


def _open_private(path: Path) -> BinaryIO:
    """``path`` opened for writing, readable by its owner only (0600 whatever the umask,
    and whatever mode a stale temporary file had)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
    except OSError:
        os.close(fd)
        raise
    return os.fdopen(fd, "wb")


def _header(block_hash: bytes, payload: bytes) -> bytes:
    if len(block_hash) > 32:
        raise ValueError("block hashes longer than 32 bytes are not supported")
    return _HEADER.pack(MAGIC, len(block_hash), block_hash.ljust(32, b"\0"), len(payload),
                        zlib.crc32(payload))


def _parse_header(raw: bytes) -> tuple[bytes, int, int]:
    if len(raw) != _HEADER.size:
        raise TransferError("truncated header")
    magic, n, padded, size, crc = _HEADER.unpack(raw)
    if magic != MAGIC or n > 32:
        raise TransferError("not a disk tier block file")
    return padded[:n], size, crc


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
