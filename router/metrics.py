"""Prometheus metrics of the router's HTTP layer (prefix ``pdserve_router_``).

Every metric lives on the ``CollectorRegistry`` given to ``RouterMetrics``, never on the
process-global default one, so several apps can coexist in one process (tests). The
dispatcher receives the same registry and registers its own metrics on it; ``/metrics``
serves the whole registry.
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "pdserve_router_"

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TOKEN_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    1.0,
    2.5,
)


class AdmissionState(Protocol):
    """What the gauges read from admission control (``admission.Admission``)."""

    num_running: int

    @property
    def num_waiting(self) -> int: ...


class RouterMetrics:
    """The router's request-level metrics. Token metrics are observed once per chunk."""

    def __init__(self, registry: CollectorRegistry,
                 admission: AdmissionState | None = None) -> None:
        self.registry = registry
        self.requests = Counter(
            f"{PREFIX}requests",
            "HTTP requests served, by endpoint and status code.",
            ["endpoint", "status_code"],
            registry=registry,
        )
        self.request_failures = Counter(
            f"{PREFIX}request_failures",
            "Generation requests that did not finish normally, by endpoint and reason: an "
            "OpenAI error code (worker_failed, too_many_requests, invalid_api_key, ...) or "
            "client_closed. A stream that failed midway counts here, not as a success.",
            ["endpoint", "reason"],
            registry=registry,
        )
        if admission is not None:
            Gauge(f"{PREFIX}num_requests_running", "Generation requests holding an "
                  "admission slot.", registry=registry).set_function(
                lambda: admission.num_running)
            Gauge(f"{PREFIX}num_requests_waiting", "Generation requests queued for an "
                  "admission slot.", registry=registry).set_function(
                lambda: admission.num_waiting)
        self.requests_in_flight = Gauge(
            f"{PREFIX}requests_in_flight",
            "Generation requests received and not yet answered.",
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds",
            "From request arrival to the first token chunk from the dispatcher.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds",
            "From request arrival to the last token of a finished generation.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Time between token chunks, divided by the number of tokens in the chunk.",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=registry,
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}prompt_tokens",
            "Prompt tokens of requests sent to the dispatcher.",
            registry=registry,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}generation_tokens",
            "Output tokens received from the dispatcher.",
            registry=registry,
        )
