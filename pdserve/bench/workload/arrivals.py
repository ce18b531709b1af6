"""Request arrival times: ``vllm bench serve``'s process, as a pure function of a seed.

Intervals are gamma-distributed with shape ``burstiness`` and scale
``1 / (rate * burstiness)``: mean ``1 / rate``, coefficient of variation
``1 / sqrt(burstiness)``; ``burstiness == 1`` is a Poisson process, below 1 burstier, above
1 more regular, ``inf`` evenly spaced. As vLLM does, ``n`` arrivals are rescaled to end at
exactly ``n / rate`` so runs with different seeds offer the same mean rate.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np


def _check(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), not {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0, not {burstiness}")


def _intervals(rng: np.random.RandomState, rate: float, burstiness: float,
               size: int) -> np.ndarray:
    if math.isinf(burstiness):
        return np.full(size, 1.0 / rate)
    return rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=size)


def arrival_times(num_requests: int, rate: float, burstiness: float = 1.0,
                  seed: int = 0) -> list[float]:
    """Seconds after the start at which each of ``num_requests`` requests is sent (the
    first after one interval, as in vLLM); all zeros for ``rate == inf``."""
    _check(rate, burstiness)
    if num_requests < 1:
        return []
    if math.isinf(rate):
        return [0.0] * num_requests
    # RandomState (numpy's legacy generator) draws the same stream as vLLM's
    # np.random.seed(seed) + np.random.gamma, so the two can be compared.
    times = np.cumsum(_intervals(np.random.RandomState(seed), rate, burstiness, num_requests))
    return (times * (num_requests / rate / times[-1])).tolist()


def arrivals_until(duration_s: float, rate: float, burstiness: float = 1.0,
                   seed: int = 0) -> Iterator[float]:
    """Arrival times below ``duration_s`` (duration mode: no rescaling, the count is
    whatever the process gives)."""
    _check(rate, burstiness)
    if math.isinf(rate):
        raise ValueError("arrivals_until needs a finite rate")
    rng = np.random.RandomState(seed)
    t = 0.0
    while True:
        for interval in _intervals(rng, rate, burstiness, 256):
            t += float(interval)
            if t >= duration_s:
                return
            yield t
