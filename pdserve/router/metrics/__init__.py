"""The router's Prometheus metrics: vLLM's names under the ``pdserve:`` prefix, and the
switch that turns them off.

Names follow vLLM's (``vllm:time_to_first_token_seconds`` ->
``pdserve:time_to_first_token_seconds``), with a ``model_name`` label where vLLM has one,
so a vLLM dashboard's queries carry over with the prefix changed. Every metric lives on
the ``CollectorRegistry`` given here, never on the process-global default one, so several
apps can coexist in one process (tests); ``/metrics`` serves that registry.

Metrics off (``--disable-metrics``): the registry is ``None``. The factories below then
return ``NULL_METRIC``, whose every method does nothing, ``RouterMetrics.tokens`` (the
per-token series, ``tokens.py``) is None, which the per-chunk path checks before reading a
clock, and ``/metrics`` answers 404.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.router.metrics.tokens import TokenSeries

PREFIX = "pdserve:"
METRICS_DISABLED_ENV = "PDSERVE_DISABLE_METRICS"
# Series at 0 from start-up, so that a fresh cluster's dashboard has every one: a finished
# generation's reasons, and the statuses and failure reasons of the cluster's own troubles
# (overload, a failed or missing worker, a timeout) and of a client that went away. Other
# label values appear with their first event.
FINISH_REASONS = ("stop", "length")
STARTUP_STATUSES = ("200", "429", "500", "503", "504")
STARTUP_FAILURE_REASONS = ("too_many_requests", "worker_failed", "no_worker_available",
                           "timeout", "client_closed")

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2,
                          0.3, 0.5, 1.0, 2.5)


class NullMetric:
    """Stands in for a Counter, Gauge or Histogram (or one of their children) while
    metrics are off: same methods, no effect."""

    __slots__ = ()

    def labels(self, *values: str, **kv: str) -> NullMetric:
        return self

    def remove(self, *values: str) -> None:
        pass

    def inc(self, amount: float = 1.0) -> None:
        pass

    def dec(self, amount: float = 1.0) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


NULL_METRIC = NullMetric()


def counter(registry: CollectorRegistry | None, name: str, doc: str,
            labels: Sequence[str] = ()) -> Counter | NullMetric:
    """``name`` without ``_total`` (prometheus_client appends it)."""
    if registry is None:
        return NULL_METRIC
    return Counter(name, doc, labels, registry=registry)


def gauge(registry: CollectorRegistry | None, name: str, doc: str,
          labels: Sequence[str] = ()) -> Gauge | NullMetric:
    if registry is None:
        return NULL_METRIC
    return Gauge(name, doc, labels, registry=registry)


def histogram(registry: CollectorRegistry | None, name: str, doc: str,
              labels: Sequence[str] = (), buckets: Sequence[float] = LATENCY_BUCKETS
              ) -> Histogram | NullMetric:
    if registry is None:
        return NULL_METRIC
    return Histogram(name, doc, labels, buckets=buckets, registry=registry)


class AdmissionState(Protocol):
    """What the gauges read from admission control (``admission.Admission``)."""

    num_running: int

    @property
    def num_waiting(self) -> int: ...


class RouterMetrics:
    """The router's request-level metrics, their ``model_name`` children bound once.
    Token metrics are observed once per chunk, and only when ``enabled``."""

    def __init__(self, registry: CollectorRegistry | None, model_name: str = "",
                 admission: AdmissionState | None = None,
                 endpoints: Sequence[str] = ()) -> None:
        """``endpoints``: the generation paths, whose request and failure series exist
        (at 0) from start-up, with the finish reasons' success series."""
        self.registry = registry
        self.enabled = registry is not None
        self.model_name = model_name
        r, m = registry, (model_name,)
        self.requests = counter(r, f"{PREFIX}http_requests", "HTTP requests served, by "
                                "endpoint and status code.", ["endpoint", "status_code"])
        self.request_failures = counter(
            r, f"{PREFIX}request_failures", "Generation requests that did not finish "
            "normally, by endpoint and reason: an OpenAI error code (worker_failed, "
            "too_many_requests, invalid_api_key, ...) or client_closed. A stream that failed "
            "midway counts here, not as a success.", ["endpoint", "reason"])
        self._success = counter(r, f"{PREFIX}request_success", "Generation requests that "
                                "finished, by finish reason (stop, length).",
                                ["model_name", "finished_reason"])
        self._success_by_reason: dict[str, Counter | NullMetric] = {
            reason: self._success.labels(model_name, reason) for reason in FINISH_REASONS}
        for endpoint in endpoints:
            for status in STARTUP_STATUSES:
                self.requests.labels(endpoint, status)
            for reason in STARTUP_FAILURE_REASONS:
                self.request_failures.labels(endpoint, reason)
        if registry is not None and admission is not None:
            running = Gauge(f"{PREFIX}num_requests_running", "Generation requests holding "
                            "an admission slot.", ["model_name"], registry=registry)
            running.labels(*m).set_function(lambda: admission.num_running)
            waiting = Gauge(f"{PREFIX}num_requests_waiting", "Generation requests queued "
                            "for an admission slot.", ["model_name"], registry=registry)
            waiting.labels(*m).set_function(lambda: admission.num_waiting)
        self.requests_in_flight = gauge(r, f"{PREFIX}requests_in_flight", "Generation "
                                        "requests received and not yet answered.")
        self.time_to_first_token = histogram(
            r, f"{PREFIX}time_to_first_token_seconds", "From request arrival to the first "
            "token chunk from the dispatcher.", ["model_name"]).labels(*m)
        self.e2e_latency = histogram(
            r, f"{PREFIX}e2e_request_latency_seconds", "From request arrival to the last "
            "token of a finished generation.", ["model_name"]).labels(*m)
        # Every streamed chunk adds to these two: counted in plain numbers (``tokens``).
        self.tokens = None if r is None else TokenSeries(
            r, f"{PREFIX}inter_token_latency_seconds", "Time between token chunks, divided by "
            "the number of tokens in the chunk.", f"{PREFIX}generation_tokens",
            "Output tokens received from the dispatcher.", model_name, _TOKEN_LATENCY_BUCKETS)
        self.prompt_tokens = counter(r, f"{PREFIX}prompt_tokens", "Prompt tokens of requests "
                                     "sent to the dispatcher.", ["model_name"]).labels(*m)

    def on_success(self, finished_reason: str) -> None:
        child = self._success_by_reason.get(finished_reason)
        if child is None:
            child = self._success_by_reason[finished_reason] = self._success.labels(
                self.model_name, finished_reason)
        child.inc()
