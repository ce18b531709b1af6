"""``DemandWindow``: the load this router was offered over a sliding window, the
planner's input (``router/cluster/planner_loop.py``): prompt tokens at arrival, output
tokens at the end, and the requests in flight now."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable

from pdserve.router.dispatch.policies.planner import Demand

Clock = Callable[[], float]


class DemandWindow:
    """The requests this router saw over the last ``window_s``: each one's uncached
    prompt tokens when it arrived, its output tokens when it ended; and how many are in
    flight. Old entries fall out as new ones come."""

    def __init__(self, window_s: float, clock: Clock = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._started_s = clock()
        self._prompts: collections.deque[tuple[float, int]] = collections.deque()
        self._outputs: collections.deque[tuple[float, int]] = collections.deque()
        self.num_inflight = 0

    def on_arrival(self, uncached_tokens: int) -> None:
        now = self._clock()
        self._prompts.append((now, uncached_tokens))
        self.num_inflight += 1
        self._forget(now)

    def on_finished(self, output_tokens: int) -> None:
        """A request counted by ``on_arrival`` ended (however it ended)."""
        now = self._clock()
        self._outputs.append((now, output_tokens))
        self.num_inflight -= 1
        self._forget(now)

    def _forget(self, now: float) -> None:
        """Entries older than the window go (on every change: memory stays bounded by
        the window's requests whether or not a planner reads it)."""
        for entries in (self._prompts, self._outputs):
            while entries and entries[0][0] < now - self._window_s:
                entries.popleft()

    def demand(self, is_long: Callable[[int], bool]) -> Demand:
        """Per second over the window (or since start, if shorter); ``is_long`` says
        which prompts belong on a prefill worker."""
        now = self._clock()
        self._forget(now)
        span = max(min(self._window_s, now - self._started_s), 1e-3)
        longs = [n for _, n in self._prompts if is_long(n)]
        long_tokens = sum(longs)
        short_tokens = sum(n for _, n in self._prompts) - long_tokens
        return Demand(long_tokens / span, short_tokens / span,
                      sum(n for _, n in self._outputs) / span, max(longs, default=0))
