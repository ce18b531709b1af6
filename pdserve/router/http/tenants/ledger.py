"""Where the tenants' limits keep their state: per tenant, the sequences in flight and
the token bucket's level, in one small block of memory that every router process of
one router maps (``--processes N``), so that the limits hold exactly across them.

``TenantLedger.create(path, ...)`` (the parent of the processes, before it starts them)
writes the block to a file (in ``/dev/shm`` where there is one: memory, never disk);
each process ``open``s and maps it, and claims a column of its own. A router of one
process uses ``TenantLedger.local``: the same code on anonymous memory.

Every change is made under one lock (``flock`` on the file, and a thread lock within
the process), held for a few loads and stores, never across an ``await`` or a system
call but the lock's own: microseconds. The kernel releases a dead holder's ``flock``.

A process that dies must not hold its slots for ever. Each process counts its
in-flight sequences in its own column, owned by (pid, process start time); a tenant's
total is the sum of the columns. Whenever a tenant would be refused for concurrency, the
owners of its columns with slots held are checked (``psutil``, outside the lock: a
process gone or a zombie is dead; a start time that differs is a reused pid), and a
dead owner's slots are freed, then the request is tried again; at most once per
``RECLAIM_EVERY_S`` per process, so a storm of refusals costs no more than before. A
restarted process (the supervisor's) claims a dead owner's column and zeroes it at once.

Layout: 8-byte words, native order; ints and floats are two views of one buffer::

    header   magic, num_tenants, num_slots, 0
    owners   num_slots x (pid: int, start time: float)
    tenants  num_tenants x (level: float, at: float, count: int x num_slots)

A bucket whose ``at`` is NaN has never been used: it is full.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psutil

from pdserve.core.process import owner_alive

_MAGIC = 0x7064746E6C656467  # "pdtnledg"
RECLAIM_EVERY_S = 1.0
_HEADER = 4
_WORD = 8


def _size(num_tenants: int, num_slots: int) -> int:
    return _WORD * (_HEADER + 2 * num_slots + num_tenants * (2 + num_slots))


def _started(pid: int) -> float:
    return psutil.Process(pid).create_time()


class TenantLedger:
    """The shared counts and buckets of ``num_tenants`` tenants (by index)."""

    def __init__(self, buffer: mmap.mmap, fd: int | None, slot: int,
                 alive: Callable[[int, float], bool] = owner_alive,
                 reclaim_every_s: float = RECLAIM_EVERY_S) -> None:
        self._buffer = buffer
        self._ints = memoryview(buffer).cast("q")
        self._floats = memoryview(buffer).cast("d")
        self._fd = fd  # None: this process's memory alone, no file lock
        self._thread_lock = threading.Lock()
        self.num_tenants = self._ints[1]
        self.num_slots = self._ints[2]
        self.slot = slot
        self._alive = alive
        self._reclaim_every_s = reclaim_every_s
        self._next_reclaim = 0.0  # time.monotonic() from which reclaim looks again

    # ---- making and opening ----------------------------------------------------------

    @classmethod
    def create(cls, path: Path, num_tenants: int, num_slots: int) -> None:
        """A fresh ledger in a new file ``path`` (mode 0600), every bucket full."""
        buffer = bytearray(_size(num_tenants, num_slots))
        ints, floats = memoryview(buffer).cast("q"), memoryview(buffer).cast("d")
        ints[0], ints[1], ints[2] = _MAGIC, num_tenants, num_slots
        for tenant in range(num_tenants):
            floats[_tenant_base(num_slots, tenant) + 1] = math.nan
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as out:
            out.write(buffer)

    @classmethod
    def open(cls, path: Path, num_tenants: int,
             alive: Callable[[int, float], bool] = owner_alive,
             reclaim_every_s: float = RECLAIM_EVERY_S) -> TenantLedger:
        """Map the ledger at ``path`` and claim a column for this process (a free one,
        or a dead process's). ValueError if it is not a ledger of at least
        ``num_tenants`` tenants, or every column has a live owner."""
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError as exc:
            raise ValueError(f"cannot open the tenant ledger {path}: {exc.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size < _WORD * _HEADER:
                raise ValueError(f"{path} is not a tenant ledger")
            buffer = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            raise
        ledger = cls(buffer, fd, -1, alive, reclaim_every_s)
        if (ledger._ints[0] != _MAGIC or ledger.num_tenants < num_tenants
                or size != _size(ledger.num_tenants, ledger.num_slots)):
            ledger.close()
            raise ValueError(f"{path} is not a tenant ledger of {num_tenants} tenants")
        ledger._claim(os.getpid())
        return ledger

    @classmethod
    def local(cls, num_tenants: int) -> TenantLedger:
        """A ledger of this process alone (one router process)."""
        buffer = mmap.mmap(-1, _size(num_tenants, 1))
        ints, floats = memoryview(buffer).cast("q"), memoryview(buffer).cast("d")
        ints[0], ints[1], ints[2] = _MAGIC, num_tenants, 1
        for tenant in range(num_tenants):
            floats[_tenant_base(1, tenant) + 1] = math.nan
        del ints, floats
        return cls(buffer, None, 0)

    def close(self) -> None:
        self._ints.release()
        self._floats.release()
        self._buffer.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _claim(self, pid: int) -> None:
        started = _started(pid)
        owners = [self._owner(slot) for slot in range(self.num_slots)]
        free = [slot for slot, (owner, at) in enumerate(owners)
                if owner == 0 or owner == pid or not self._alive(owner, at)]
        with self._locked():
            for slot in free:
                if self._owner(slot) == owners[slot]:  # nobody claimed it meanwhile
                    self._set_owner(slot, pid, started)
                    self.slot = slot
                    break
        if self.slot < 0:
            self.close()
            raise ValueError(f"every one of the tenant ledger's {self.num_slots} columns "
                             "has a live owner")

    # ---- the state, under the lock ---------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock for a few loads and stores: never across an ``await``."""
        with self._locked():
            yield

    def num_running(self, tenant: int) -> int:
        """The tenant's sequences in flight, in every process (read without the lock)."""
        base = _tenant_base(self.num_slots, tenant) + 2
        return sum(self._ints[base:base + self.num_slots])

    def bucket(self, tenant: int) -> tuple[float, float]:
        """(level, at) of the tenant's bucket (at NaN: never used, full); under ``locked``."""
        base = _tenant_base(self.num_slots, tenant)
        return self._floats[base], self._floats[base + 1]

    def set_bucket(self, tenant: int, level: float, at: float) -> None:
        base = _tenant_base(self.num_slots, tenant)
        self._floats[base], self._floats[base + 1] = level, at

    def add(self, tenant: int, num: int) -> None:
        """Count ``num`` (may be negative) more in flight in this process's column."""
        self._ints[_tenant_base(self.num_slots, tenant) + 2 + self.slot] += num

    # ---- dead processes --------------------------------------------------------------

    def reclaim(self, tenant: int) -> int:
        """Free the slots that dead processes hold for ``tenant`` (their whole columns);
        the number freed. Checks the owners outside the lock, at most once per
        ``reclaim_every_s``."""
        now = time.monotonic()
        if now < self._next_reclaim:
            return 0
        self._next_reclaim = now + self._reclaim_every_s
        base = _tenant_base(self.num_slots, tenant) + 2
        suspects = [(slot, self._owner(slot)) for slot in range(self.num_slots)
                    if slot != self.slot and self._ints[base + slot] > 0]
        dead = [(slot, owner) for slot, owner in suspects
                if owner[0] == 0 or not self._alive(*owner)]
        freed = 0
        with self._locked():
            for slot, owner in dead:
                if self._owner(slot) == owner:  # not claimed by a successor meanwhile
                    freed += self._clear_column(slot)
        return freed

    def _clear_column(self, slot: int) -> int:
        freed = 0
        for tenant in range(self.num_tenants):
            index = _tenant_base(self.num_slots, tenant) + 2 + slot
            freed += self._ints[index]
            self._ints[index] = 0
        return freed

    def _owner(self, slot: int) -> tuple[int, float]:
        return self._ints[_HEADER + 2 * slot], self._floats[_HEADER + 2 * slot + 1]

    def _set_owner(self, slot: int, pid: int, started: float) -> None:
        self._clear_column(slot)
        self._ints[_HEADER + 2 * slot] = pid
        self._floats[_HEADER + 2 * slot + 1] = started

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            if self._fd is None:
                yield
                return
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)


def _tenant_base(num_slots: int, tenant: int) -> int:
    return _HEADER + 2 * num_slots + tenant * (2 + num_slots)


def ledger_path(directory: Path | None = None) -> Path:
    """Where a new ledger goes: ``/dev/shm`` (memory) when there is one."""
    if directory is None:
        shm = Path("/dev/shm")
        directory = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path("/tmp")
    return directory / f"pdserve-tenants-{os.getpid()}-{os.urandom(6).hex()}"
