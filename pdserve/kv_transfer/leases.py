"""The KV blocks a prefill worker holds for decode workers, each under a lease.

Owned by the prefill rank's worker-side connector. The engine's scheduler keeps
the blocks allocated until the request id is reported in ``finished_sending``;
this table decides when that happens: after a pull, a release, or lease expiry.
A pull after expiry is refused, since the blocks may already hold other data.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# How long the ids of ended leases are remembered, to refuse late pulls at once.
_TOMBSTONE_S = 300.0


class LeaseError(RuntimeError):
    """The request holds no (live) lease on this worker."""


@dataclass
class _Lease:
    block_ids: tuple[int, ...]
    deadline: float  # time.time()
    in_transfer: bool = False


class LeaseTable:
    def __init__(
        self, clock: Callable[[], float] = time.time, on_end: Callable[[], None] | None = None
    ) -> None:
        self._clock = clock
        self._on_end = on_end  # called (under the lock) whenever a lease ends
        self._cond = threading.Condition()
        self._held: dict[str, _Lease] = {}
        self._ended: dict[str, tuple[float, str]] = {}  # id -> (when, why)
        self._done: set[str] = set()
        self.num_expired = 0

    def add(self, request_id: str, block_ids: Sequence[int], deadline: float) -> None:
        with self._cond:
            if request_id in self._ended:  # released before its lease arrived
                self._done.add(request_id)
                if self._on_end is not None:
                    self._on_end()
                return
            self._held[request_id] = _Lease(tuple(block_ids), deadline)
            self._cond.notify_all()

    def checkout(self, request_id: str, wait_s: float) -> tuple[int, ...]:
        """Mark a lease in transfer and return its blocks.

        The scheduler tells this worker about a lease one engine step after the
        request finished, so a fast decode may ask first: wait up to ``wait_s``.
        """
        end = time.monotonic() + wait_s
        with self._cond:
            while request_id not in self._held:
                self._raise_if_ended(request_id)
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise LeaseError(f"no KV lease for request {request_id}")
                self._cond.wait(remaining)
            lease = self._held[request_id]
            if lease.in_transfer:
                raise LeaseError(f"request {request_id} is already being transferred")
            if lease.deadline <= self._clock():
                self._end(request_id, "expired")
                self.num_expired += 1
                raise LeaseError(f"KV lease for request {request_id} expired")
            lease.in_transfer = True
            return lease.block_ids

    def finish(self, request_id: str, why: str = "transferred") -> bool:
        """End a lease (after a pull, or on release); its blocks are freed next step."""
        with self._cond:
            if request_id not in self._held:
                if request_id not in self._ended:
                    self._ended[request_id] = (self._clock(), f"{why} before lease")
                return False
            self._end(request_id, why)
            return True

    def wait_and_finish(self, request_id: str, wait_s: float, why: str) -> bool:
        """Release a lease that may not have arrived yet (waits up to ``wait_s``)."""
        end = time.monotonic() + wait_s
        with self._cond:
            while request_id not in self._held and request_id not in self._ended:
                remaining = end - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return self.finish(request_id, why)

    def expire(self) -> int:
        """End leases past their deadline that are not in transfer."""
        now = self._clock()
        with self._cond:
            expired = [
                rid
                for rid, lease in self._held.items()
                if lease.deadline <= now and not lease.in_transfer
            ]
            for rid in expired:
                self._end(rid, "expired")
            self.num_expired += len(expired)
            for rid in [r for r, (t, _) in self._ended.items() if now - t > _TOMBSTONE_S]:
                del self._ended[rid]
        return len(expired)

    def take_done(self) -> set[str]:
        with self._cond:
            done, self._done = self._done, set()
        return done

    @property
    def has_done(self) -> bool:
        with self._cond:
            return bool(self._done)

    @property
    def num_held(self) -> int:
        with self._cond:
            return len(self._held)

    def _end(self, request_id: str, why: str) -> None:
        del self._held[request_id]
        self._ended[request_id] = (self._clock(), why)
        self._done.add(request_id)
        self._cond.notify_all()
        if self._on_end is not None:
            self._on_end()

    def _raise_if_ended(self, request_id: str) -> None:
        if request_id in self._ended:
            why = self._ended[request_id][1]
            raise LeaseError(f"KV lease for request {request_id} ended: {why}")
