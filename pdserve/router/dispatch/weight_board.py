"""What the router processes of one router share about its weights, so that a refit
through any of them is one refit for all (``--processes N``): whether admission is
closed (an update, or vLLM's ``/pause``), each process's admitted requests (a drain
waits for all of them), the last abort asked for (every process ends its own), and
the version requests are admitted under (with the workers that committed it), and the
LoRA adapters loaded and unloaded through any of them (``workers/loras.LoraTargets``:
every process replays them on workers that join, and routes by them).

``WeightBoard.create(path, num_slots)`` (the parent of the processes, before it starts
them, as it does the tenants' ledger) writes a small file in ``/dev/shm``; each process
``open``s and maps it and claims a slot of its own (a dead owner's slot is taken over
and zeroed). A router of one process uses ``WeightBoard.local()``: the same code on
anonymous memory. One update runs at a time in the whole router: its process holds
``flock`` on the file for the update's length (the kernel releases a dead holder's).

Layout: 8-byte words, native order; then the published state and the LoRA targets as
JSON::

    header   magic, num_slots, closing, paused, committing, abort_epoch, abort_keep,
             version_epoch, state_len, lora_epoch
    slots    num_slots x (pid, start time as float bits, running, abort_ack)
    state    STATE_BYTES of JSON: {"version", "source", "workers": {worker id: version}}
    loras    a length word, then LORA_BYTES - 8 of JSON: {"loaded": {name: folder},
             "unloaded": [name, ...]}, read and written under a byte-range lock

Each word has one writer at a time (a slot: its process; the rest: the process that
holds the update lock, or ``/pause``'s caller), and a reader that sees a stale value
sees it for one poll: the waits here poll (``POLL_S``), they never spin.
"""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from pdserve.core.process import owner_alive

_MAGIC = 0x7064776569676874  # "pdweight"
_HEADER = 10
_SLOT = 4
STATE_BYTES = 16384
LORA_BYTES = 65536  # some hundreds of adapters' names and folders
POLL_S = 0.01
# Header words.
_SLOTS, _CLOSING, _PAUSED, _COMMITTING, _ABORT, _KEEP, _EPOCH, _STATE_LEN, _LORA_EPOCH = \
    range(1, 10)
# Byte ranges locked with lockf: a slot claim; the LoRA targets' read-modify-write.
_CLAIM_LOCK, _LORA_LOCK = (0, 8), (8, 8)


@dataclass(frozen=True)
class Published:
    """The version requests are admitted under, the folder it came from ("": pushed by
    a trainer, or none), and the version each worker that committed it serves."""

    version: str = ""
    source: str = ""
    workers: dict[str, str] = field(default_factory=dict)


class UpdateRunning(RuntimeError):
    """Another process of this router runs a weight update."""


def _size(num_slots: int) -> int:
    return 8 * (_HEADER + _SLOT * num_slots) + STATE_BYTES + LORA_BYTES


def _bits(value: float) -> int:
    return int(struct.unpack("q", struct.pack("d", value))[0])


def _float(bits: int) -> float:
    return float(struct.unpack("d", struct.pack("q", bits))[0])


class WeightBoard:
    def __init__(self, buffer: mmap.mmap, fd: int | None) -> None:
        self._buffer = buffer
        self._words = memoryview(buffer).cast("q")
        self._fd = fd  # None: this process alone, no file lock
        self._slot = self._claim()

    # ---- creation ----

    @staticmethod
    def create(path: Path, num_slots: int) -> None:
        """Write an empty board for ``num_slots`` processes at ``path``."""
        data = bytearray(_size(num_slots))
        struct.pack_into("qq", data, 0, _MAGIC, num_slots)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)  # as the ledger: a new file
        try:
            os.write(fd, bytes(data))
        finally:
            os.close(fd)

    @classmethod
    def open(cls, path: Path) -> WeightBoard:
        fd = os.open(path, os.O_RDWR)
        size = os.fstat(fd).st_size
        buffer = mmap.mmap(fd, size)
        if size < 16 or struct.unpack_from("q", buffer, 0)[0] != _MAGIC:
            os.close(fd)
            raise ValueError(f"{path} is not a pdserve weight board")
        return cls(buffer, fd)

    @classmethod
    def local(cls) -> WeightBoard:
        buffer = mmap.mmap(-1, _size(1))
        struct.pack_into("qq", buffer, 0, _MAGIC, 1)
        return cls(buffer, None)

    def close(self) -> None:
        self._words.release()
        self._buffer.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    # ---- admission ----

    @property
    def closed(self) -> bool:
        return bool(self._words[_CLOSING] or self._words[_PAUSED])

    @property
    def paused(self) -> bool:
        return bool(self._words[_PAUSED])

    def set_closing(self, closing: bool) -> None:
        self._words[_CLOSING] = int(closing)

    def set_paused(self, paused: bool) -> None:
        self._words[_PAUSED] = int(paused)

    @property
    def committing(self) -> bool:
        return bool(self._words[_COMMITTING])

    def set_committing(self, committing: bool) -> None:
        self._words[_COMMITTING] = int(committing)

    def set_running(self, num: int) -> None:
        """This process's admitted requests."""
        self._words[self._base(self._slot) + 2] = num

    def num_running(self) -> int:
        """Every live process's admitted requests."""
        return sum(self._words[self._base(i) + 2] for i in self._live_slots())

    # ---- aborts ----

    @property
    def abort_epoch(self) -> int:
        return self._words[_ABORT]

    @property
    def abort_keeps(self) -> bool:
        """Whether the last abort keeps what it ends (``/pause?mode=keep``)."""
        return bool(self._words[_KEEP])

    def request_abort(self, keep: bool) -> int:
        """Ask every process to end its running requests; the abort's epoch."""
        self._words[_KEEP] = int(keep)
        self._words[_ABORT] += 1
        return self._words[_ABORT]

    def ack_abort(self, epoch: int) -> None:
        self._words[self._base(self._slot) + 3] = epoch

    def all_acked(self, epoch: int) -> bool:
        return all(self._words[self._base(i) + 3] >= epoch for i in self._live_slots())

    # ---- the version ----

    @property
    def version_epoch(self) -> int:
        return self._words[_EPOCH]

    def publish(self, state: Published) -> None:
        data = json.dumps({"version": state.version, "source": state.source,
                           "workers": state.workers}).encode()
        if len(data) > STATE_BYTES:  # thousands of workers: drop the list, keep the version
            data = json.dumps({"version": state.version, "source": state.source,
                               "workers": {}}).encode()
        offset = 8 * (_HEADER + _SLOT * self._num_slots)
        self._buffer[offset:offset + len(data)] = data
        self._words[_STATE_LEN] = len(data)
        self._words[_EPOCH] += 1

    def published(self) -> Published:
        offset = 8 * (_HEADER + _SLOT * self._num_slots)
        raw: dict[str, Any] = json.loads(
            bytes(self._buffer[offset:offset + self._words[_STATE_LEN]]) or b"{}")
        return Published(str(raw.get("version", "")), str(raw.get("source", "")),
                         {str(k): str(v) for k, v in raw.get("workers", {}).items()})

    # ---- the LoRA targets ----

    @property
    def lora_epoch(self) -> int:
        """Bumped by each change of the LoRA targets."""
        return self._words[_LORA_EPOCH]

    def loras(self) -> dict[str, Any]:
        """The LoRA targets as the last change left them (``{}``: none yet)."""
        with self._byte_lock(_LORA_LOCK):
            return self._read_loras()

    def change_loras(self, change: Callable[[dict[str, Any]], None]) -> None:
        """Read the targets, apply ``change`` to them and write them back, one process at
        a time; ``ValueError`` (nothing written) when they outgrow the board."""
        with self._byte_lock(_LORA_LOCK):
            raw = self._read_loras()
            change(raw)
            data = json.dumps(raw).encode()
            if len(data) > LORA_BYTES - 8:
                raise ValueError("too many LoRA adapters to share between the router's "
                                 f"processes ({len(data)} bytes of names and folders)")
            offset = self._lora_offset
            self._buffer[offset + 8:offset + 8 + len(data)] = data
            struct.pack_into("q", self._buffer, offset, len(data))
            self._words[_LORA_EPOCH] += 1

    def _read_loras(self) -> dict[str, Any]:
        offset = self._lora_offset
        (length,) = struct.unpack_from("q", self._buffer, offset)
        raw: dict[str, Any] = json.loads(bytes(self._buffer[offset + 8:offset + 8 + length])
                                         or b"{}")
        return raw

    @property
    def _lora_offset(self) -> int:
        return 8 * (_HEADER + _SLOT * self._num_slots) + STATE_BYTES

    @contextmanager
    def _byte_lock(self, span: tuple[int, int]) -> Iterator[None]:
        """``span`` (start, length) of the file locked, blocking (held for microseconds);
        nothing to lock for a board of one process."""
        if self._fd is not None:
            fcntl.lockf(self._fd, fcntl.LOCK_EX, span[1], span[0])
        try:
            yield
        finally:
            if self._fd is not None:
                fcntl.lockf(self._fd, fcntl.LOCK_UN, span[1], span[0])

    # ---- one update at a time ----

    @contextmanager
    def update_lock(self) -> Iterator[None]:
        """Held for an update's length; raises ``UpdateRunning`` when another process
        holds it."""
        if self._fd is not None:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as exc:
                raise UpdateRunning("another router process runs a weight update") from exc
        try:
            yield
        finally:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    # ---- slots ----

    @property
    def _num_slots(self) -> int:
        return self._words[_SLOTS]

    @staticmethod
    def _base(slot: int) -> int:
        return _HEADER + _SLOT * slot

    def _live_slots(self) -> list[int]:
        return [i for i in range(self._num_slots) if i == self._slot or (
            self._words[self._base(i)] and owner_alive(self._words[self._base(i)],
                                                  _float(self._words[self._base(i) + 1])))]

    def _claim(self) -> int:
        """A free slot, or a dead owner's (zeroed); raises ``ValueError`` when every slot
        has a live owner."""
        pid = os.getpid()
        started = psutil.Process(pid).create_time()
        with self._byte_lock(_CLAIM_LOCK):  # claims one at a time
            for i in range(self._num_slots):
                base = self._base(i)
                owner = self._words[base]
                if owner and owner_alive(owner, _float(self._words[base + 1])):
                    continue
                self._words[base + 1] = _bits(started)
                self._words[base + 2] = 0
                self._words[base + 3] = self._words[_ABORT]  # no abort owed from before
                self._words[base] = pid
                return i
            raise ValueError(f"every slot of the weight board ({self._num_slots}) is taken")
