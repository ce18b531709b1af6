"""Stamps one Generate call on its worker, for the router's per-request timeline.

Wall-clock stamps (``time.time_ns``) because the router joins two workers' stamps into
the handoff (prefill's first token out -> decode admitted); the engine's own durations
(queue, compute) come from its monotonic clock and are passed in as they are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from pdserve.core.types import PhaseTiming


class PhaseClock:
    """Created when the worker admits a call; told of every output it sends."""

    __slots__ = ("admitted_unix_ns", "first_token_unix_ns", "waited_ns")

    def __init__(self) -> None:
        self.admitted_unix_ns = time.time_ns()
        self.first_token_unix_ns = 0
        self.waited_ns = 0  # for its turn in front of the engine (the role's admission)

    def on_output(self, token_ids: Sequence[int]) -> None:
        if token_ids and not self.first_token_unix_ns:
            self.first_token_unix_ns = time.time_ns()

    def timing(self, queue_ns: int = 0, compute_ns: int = 0, kv_load_ns: int = 0
               ) -> PhaseTiming:
        """``queue_ns``: the engine's own queue; the wait in front of it is added."""
        return PhaseTiming(self.admitted_unix_ns, self.first_token_unix_ns,
                           queue_ns + self.waited_ns, compute_ns, kv_load_ns)
