"""``pdserve bench``'s arrival process: the configured mean rate and burstiness (the
coefficient of variation of the intervals is 1/sqrt(burstiness)), seeded. Every check is
deterministic for its seed, and its tolerance is many standard errors wide."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.bench.workload.arrivals import arrival_times, arrivals_until

N = 20_000


def _intervals(times: list[float]) -> np.ndarray:
    return np.diff(np.concatenate([[0.0], times]))


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
@pytest.mark.parametrize("seed", [0, 7])
def test_the_process_has_the_configured_mean_rate_and_burstiness(burstiness: float,
                                                                  seed: int) -> None:
    rate = 4.0
    times = arrival_times(N, rate, burstiness, seed)
    assert len(times) == N and times == sorted(times)
    assert times[-1] == pytest.approx(N / rate)  # vLLM's rescaling: exactly the mean rate
    gaps = _intervals(times)
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    cv = gaps.std() / gaps.mean()
    # The CV's standard error at N = 20k is below 2 %; 10 % cannot be missed by chance.
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.10)


def test_the_same_seed_gives_the_same_times_and_another_seed_other_times() -> None:
    assert arrival_times(100, 2.0, 1.0, seed=3) == arrival_times(100, 2.0, 1.0, seed=3)
    assert arrival_times(100, 2.0, 1.0, seed=3) != arrival_times(100, 2.0, 1.0, seed=4)


def test_duration_mode_offers_the_rate_over_the_duration() -> None:
    rate, duration = 50.0, 400.0
    times = list(arrivals_until(duration, rate, 1.0, seed=1))
    assert all(0 < t < duration for t in times) and times == sorted(times)
    # Poisson: 20,000 expected, standard deviation ~141; 5 % is 7 standard deviations.
    assert len(times) == pytest.approx(rate * duration, rel=0.05)
    assert times == list(arrivals_until(duration, rate, 1.0, seed=1))


def test_infinite_rate_sends_everything_at_once_and_infinite_burstiness_evenly() -> None:
    assert arrival_times(5, math.inf) == [0.0] * 5
    assert arrival_times(4, 2.0, math.inf) == pytest.approx([0.5, 1.0, 1.5, 2.0])


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_a_non_positive_rate_or_burstiness_is_refused(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        arrival_times(10, rate, burstiness)
