"""What this worker has measured of the path to each KV peer: the rate its pulls' bytes
came at, per peer (``host:port`` of the peer's KV endpoint).

Each pull of at least ``MIN_SAMPLE_BYTES`` is a sample: its bytes over the time they took
to arrive (from the peer's first reply to the last byte: the lease wait and the handshake
are not the link's). The estimate is a moving average of *seconds per byte*, not of
bytes per second, so that one slow transfer pulls the estimate most of the way down (a
link that got thin is believed at once; a fast sample after slow ones raises it more
slowly). An estimate older than ``max_age_s`` is dropped: the router then decides as if
it had none, sends a long prompt's KV over the path again, and so measures it afresh
(the only way a path that was thin is found fast again: nothing crosses it while the
router computes those prompts on decode).

The router reads the estimates from ``GetLoad`` (``kv_links``) and prices a long
prompt's handoff with them (``router/dispatch/policies/link_cost.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_SAMPLE_BYTES = 1 << 20  # smaller pulls are dominated by round trips, not the rate
NEW_SAMPLE_WEIGHT = 0.7
DEFAULT_MAX_AGE_S = 60.0


@dataclass(frozen=True)
class LinkEstimate:
    """One peer's path, as measured here."""

    peer: str
    bytes_per_s: float
    bytes_per_token: float  # what one prompt token's KV weighed on the wire
    samples: int
    age_s: float  # since the latest sample


class LinkMeter:
    """Thread-safe: pulls record from the connector's threads, ``estimates`` is read by
    the status op."""

    def __init__(self, max_age_s: float = DEFAULT_MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not max_age_s > 0:
            raise ValueError(f"max_age_s must be > 0, got {max_age_s}")
        self._max_age_s = max_age_s
        self._clock = clock
        self._lock = threading.Lock()
        # peer -> (seconds per byte, bytes per block, samples, time of the latest)
        self._paths: dict[str, tuple[float, float, int, float]] = {}

    def record(self, peer: str, nbytes: int, num_tokens: int, seconds: float) -> None:
        """One pull from ``peer``: ``nbytes`` (the KV of ``num_tokens`` tokens: whole
        blocks) in ``seconds``."""
        if nbytes < MIN_SAMPLE_BYTES or seconds <= 0 or num_tokens <= 0:
            return
        per_byte, per_token = seconds / nbytes, nbytes / num_tokens
        now = self._clock()
        with self._lock:
            old = self._paths.get(peer)
            if old is not None and now - old[3] <= self._max_age_s:
                per_byte = NEW_SAMPLE_WEIGHT * per_byte + (1 - NEW_SAMPLE_WEIGHT) * old[0]
                samples = old[2] + 1
            else:
                samples = 1
            self._paths[peer] = (per_byte, per_token, samples, now)

    def estimates(self) -> list[LinkEstimate]:
        """Every path measured within ``max_age_s`` (older ones are forgotten)."""
        now = self._clock()
        with self._lock:
            for peer in [p for p, v in self._paths.items() if now - v[3] > self._max_age_s]:
                del self._paths[peer]
            return [LinkEstimate(peer, 1.0 / per_byte, per_token, samples, now - at)
                    for peer, (per_byte, per_token, samples, at) in sorted(self._paths.items())]

    def estimate(self, peer: str) -> LinkEstimate | None:
        """``peer``'s path, if measured within ``max_age_s``."""
        return next((e for e in self.estimates() if e.peer == peer), None)

    def status(self) -> list[dict[str, float | int | str]]:
        """``estimates`` as the KV endpoint's status op sends them."""
        return [{"peer": e.peer, "bytes_per_s": e.bytes_per_s,
                 "bytes_per_token": e.bytes_per_token, "samples": e.samples,
                 "age_s": e.age_s} for e in self.estimates()]
