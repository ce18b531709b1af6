"""The per-token series kept in plain numbers read, at a scrape, as prometheus_client's
own Histogram and Counter fed the same chunks would."""

from __future__ import annotations

import random
from unittest import mock

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import _TOKEN_LATENCY_BUCKETS, RouterMetrics
from pdserve.router.metrics.tokens import TokenSeries


def _samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of the scrape but the ``_created`` times, by name and labels."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created")}


def test_the_series_scrape_as_prometheus_clients_histogram_and_counter() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    series = TokenSeries(ours, "t:itl_seconds", "doc", "t:tokens", "doc", "m",
                         _TOKEN_LATENCY_BUCKETS)
    histogram = Histogram("t:itl_seconds", "doc", ["model_name"], registry=theirs,
                          buckets=_TOKEN_LATENCY_BUCKETS).labels("m")
    counter = Counter("t:tokens", "doc", ["model_name"], registry=theirs).labels("m")
    rng, clock = random.Random(7), [100.0]
    # Gaps on and around every bound (a bound is inside its bucket), 0 and past the last.
    gaps = [*_TOKEN_LATENCY_BUCKETS, 0.0, 9.0, *(rng.uniform(0, 3) for _ in range(300))]
    series.count(3)
    counter.inc(3)
    with mock.patch("time.perf_counter", lambda: clock[0]):
        last = clock[0]
        for gap in gaps:
            num = rng.choice((1, 1, 2, 5, 0))
            clock[0] += gap * num
            last = series.chunk(last, num)
            if num:  # a chunk without tokens is no observation
                histogram.observe((clock[0] - (clock[0] - gap * num)) / num)
                counter.inc(num)
    expected = _samples(theirs)
    assert _samples(ours).keys() == expected.keys()
    for key, value in _samples(ours).items():
        assert abs(value - expected[key]) <= 1e-9 * max(1.0, abs(value)), key
    assert expected[("t:tokens_total", (("model_name", "m"),))] > 300


def test_the_router_exposes_them_at_0_from_start_up() -> None:
    registry = CollectorRegistry()
    RouterMetrics(registry, "m")
    samples = _samples(registry)
    model = (("model_name", "m"),)
    assert samples[("pdserve:generation_tokens_total", model)] == 0
    assert samples[("pdserve:inter_token_latency_seconds_count", model)] == 0
    assert samples[("pdserve:inter_token_latency_seconds_bucket",
                    (("le", "+Inf"), ("model_name", "m")))] == 0


def test_metrics_off_have_no_series() -> None:
    assert RouterMetrics(None, "m").tokens is None
