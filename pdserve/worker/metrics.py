"""A worker's Prometheus ``/metrics`` listener (``--metrics-port``).

It serves two sources, read at scrape time:

- the engine's own ``vllm:*`` metrics, exactly as vLLM exports them: vLLM's
  ``PrometheusStatLogger`` registers them on prometheus_client's global ``REGISTRY``,
  in this process, since ``AsyncLLM`` runs in-process;
- the worker's ``pdserve:*`` metrics (``WorkerCollector``): its connector's counters
  and its own state, taken from the same report ``GetLoad`` answers with, on the
  worker's event loop, within ``SCRAPE_DEADLINE_S`` (past it, the last-known values).

Labels stay bounded across restarts: ``model_name``, ``role`` and ``transport``; the
worker id appears only on ``pdserve:worker_info`` (one series per process).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.core.types import WorkerHealth, WorkerLoadReport
from pdserve.core.version import version
from pdserve.worker.backend import WorkerBackend
from pdserve.worker.lifecycle import ServingState

logger = logging.getLogger("pdserve.worker")

# Under Prometheus's default scrape timeout (10 s); the connector's own status
# request inside the sample has 1 s (``kv_status.KV_STATUS_TIMEOUT_S``).
SCRAPE_DEADLINE_S = 2.0
_ANY_HOST = ("0.0.0.0", "::", "")
LABELS = ("model_name", "role", "transport")
# (name, help, value from the load report)
LoadMetric = tuple[str, str, Callable[[WorkerLoadReport], float]]


Rows = tuple[tuple[str, str], ...]  # (GetLoad field after ``kv_<tier>_``, help)


def _kv_counters(tier: str, label: str, rows: Rows) -> tuple[LoadMetric, ...]:
    """GetLoad's ``kv_<tier>_<field>`` counters as ``pdserve:kv_<tier>_<field>_total``;
    a ``*_time_ns`` field is exported in seconds (``*_seconds_total``)."""
    def metric(field: str, doc: str) -> LoadMetric:
        attr, seconds = f"kv_{tier}_{field}", field.endswith("_time_ns")
        name = field.removesuffix("_time_ns") + "_seconds" if seconds else field
        scale = 1e-9 if seconds else 1.0
        return (f"pdserve:kv_{tier}_{name}_total", f"{label}: {doc}",
                lambda r: getattr(r, attr) * scale)

    return tuple(metric(field, doc) for field, doc in rows)


def _load_rows(source: str, failure: str) -> Rows:
    """What every tier (host, disk, the pool) counts of its loads."""
    return (("loads", f"requests whose prefix was loaded {source}"),
            ("load_blocks", f"KV blocks loaded {source}"),
            ("load_bytes", f"KV bytes loaded {source}"),
            ("load_time_ns", "time its loads took"),
            ("load_failures", f"loads that failed {failure}; the prompt was recomputed"))


def _save_rows(saved: str, saves: str, failure: str) -> Rows:
    """What a local tier (host, disk) counts of its saves, and its evictions."""
    return (("saves", f"finished requests whose blocks were {saved}"),
            ("save_blocks", f"KV blocks {saved} to it"),
            ("save_failures", f"{saves} that failed{failure}"),
            ("evictions", "KV blocks evicted (least recently used) to make room"))


_MISS_ROWS: Rows = (("miss_blocks", "prompt blocks past the engine's own prefix-cache hits "
                     "that no local tier (host, disk) held"),)
_SERVE_ROWS: Rows = (
    ("serves", "peers' pulls served from this worker's host tier"),
    ("serve_blocks", "KV blocks served to peers"),
    ("serve_failures", "peers' pulls that failed: refused (block no longer held) or broken"),
    ("load_refusals", "pulls a peer refused: its KV settings differ (--kv-compression, "
     "layout); the prompt was recomputed"),
    ("serve_refusals", "peers' pulls refused: their --kv-compression differs from this "
     "worker's"))

_STORE_ROWS: Rows = (
    ("lookups", "lookups of a prompt's blocks (one round trip each)"),
    ("hit_blocks", "KV blocks the lookups found"),
    ("lookup_errors", "lookups that failed (the store unreachable, refusing, or too "
     "slow); the prompt was computed"),
    ("lookup_timeouts", "lookups that passed their deadline (--kv-store-timeout-s)"),
    ("lookups_skipped", "lookups not made while the store was down after a failure"),
    ("fetch_chosen", "prompts whose stored blocks were loaded: fetching beat computing"),
    ("compute_chosen", "prompts whose stored blocks were computed: computing beat "
     "fetching"),
    *_load_rows("from the store", "(a block missing, bad or the store failing: from "
                "that block on)"),
    ("load_missing", "KV blocks a load found missing (expired, evicted) or refused"),
    ("bad_blocks", "KV blocks refused: checksum or encoding wrong"),
    ("bad_deleted", "bad KV values deleted from the store (so a good one can be "
     "published)"),
    ("timeouts", "store calls (loads, writes) that passed their deadline"),
    ("save_blocks", "KV blocks copied out of the cache to publish"),
    ("save_dropped", "KV blocks not published: the writer's queue was full"),
    ("put_written", "KV blocks written to the store (new to it)"),
    ("put_failures", "writes to the store that failed"),
    ("not_admitted", "KV blocks not published: --kv-store-admission refused them or an "
     "earlier block of their request"))

# Counters' names end in _total.
_COUNTERS: tuple[LoadMetric, ...] = (
    ("pdserve:kv_transfers_completed_total",
     "KV transfers served (prefill) or loaded (decode) successfully",
     lambda r: r.kv_transfers_completed),
    ("pdserve:kv_transfers_failed_total", "KV transfers that failed (peer gone, deadline, "
     "refused)", lambda r: r.kv_transfers_failed),
    ("pdserve:kv_transfer_bytes_sent_total", "KV bytes served to decode workers",
     lambda r: r.kv_bytes_sent),
    ("pdserve:kv_transfer_bytes_received_total", "KV bytes loaded from prefill workers",
     lambda r: r.kv_bytes_received),
    ("pdserve:kv_transfer_seconds_total", "Time spent serving (prefill) or receiving "
     "(decode) KV transfers", lambda r: r.kv_transfer_time_ns / 1e9),
    ("pdserve:kv_loads_total", "Decode: KV loads finished (pulled or taken from the push "
     "inbox)", lambda r: r.kv_loads),
    ("pdserve:kv_load_seconds_total", "Decode: time requests waited for their KV loads",
     lambda r: r.kv_load_time_ns / 1e9),
    ("pdserve:kv_push_loads_total", "Decode: loads served from pushed KV",
     lambda r: r.kv_push_loads),
    ("pdserve:kv_push_fallbacks_total", "Decode: loads whose pushed KV was unusable and "
     "were pulled instead", lambda r: r.kv_push_fallbacks),
    ("pdserve:kv_layers_pushed_total", "Prefill: KV layers pushed to decode workers",
     lambda r: r.kv_layers_pushed),
    ("pdserve:kv_pushes_failed_total", "Prefill: transfers whose push failed (the decode "
     "pulled)", lambda r: r.kv_pushes_failed),
    ("pdserve:kv_leases_expired_total", "Prefill: KV leases that expired before a decode "
     "loaded or released them", lambda r: r.kv_leases_expired),
    *_kv_counters("tier", "Host tier", _load_rows("from it", "(checksum, evicted)")
                  + _save_rows("saved", "saves", "")),
    *_kv_counters("disk", "Disk tier",
                  _load_rows("from it", "(a missing, truncated or corrupt file)")
                  + _save_rows("written", "writes", " (a full disk)")),
    *_kv_counters("tier", "KV tiers", _MISS_ROWS),
    *_kv_counters("pool", "KV pool",
                  _load_rows("from a peer's host tier", "(peer gone, blocks no longer held)")
                  + _SERVE_ROWS),
    *_kv_counters("store", "KV store", _STORE_ROWS),
    ("pdserve:kv_encoded_pulls_total", "Decode: KV pulls from prefill workers whose "
     "blocks came encoded (--kv-compression, on a path thin enough that it pays)",
     lambda r: r.kv_encoded_pulls),
    ("pdserve:kv_encoded_bytes_saved_total", "Decode: KV bytes those encoded pulls did "
     "not move (raw minus encoded)", lambda r: r.kv_encoded_bytes_saved),
    ("pdserve:kv_encoded_pull_refusals_total", "Decode: encoded pulls a prefill refused "
     "(another --kv-compression); pulled raw, and raw from it for a while",
     lambda r: r.kv_encoded_pull_refusals),
)
_GAUGES: tuple[LoadMetric, ...] = (
    ("pdserve:kv_leases_held", "Prefill: requests whose KV is held for a decode",
     lambda r: r.kv_leases_held),
    ("pdserve:kv_pending_transfers", "KV held for a decode (prefill) or being loaded "
     "(decode)", lambda r: r.num_pending_transfers),
    ("pdserve:kv_push_inbox_bytes", "Decode: pushed KV bytes staged for their requests",
     lambda r: r.kv_push_inbox_bytes),
    ("pdserve:worker_inflight_requests", "Requests in the worker's gRPC service",
     lambda r: r.num_inflight_reqs),
)


@dataclass(frozen=True)
class MetricsListener:
    """Where a worker serves ``/metrics``: bound on ``host:port`` (port 0: off),
    reached at ``endpoint``."""

    host: str
    port: int
    advertise_host: str

    @property
    def endpoint(self) -> str:
        """``host:port`` others scrape; "" when off."""
        return f"{self.advertise_host}:{self.port}" if self.port else ""

    @classmethod
    def from_flags(cls, metrics_host: str | None, metrics_port: int, host: str,
                   advertise_host: str) -> MetricsListener:
        """``--metrics-host`` defaults to the worker's ``--host``; bound on any address,
        it is advertised where the worker is."""
        bind = metrics_host or host
        return cls(bind, metrics_port, advertise_host if bind in _ANY_HOST else bind)


@dataclass(frozen=True)
class WorkerSample:
    """What one scrape reports: whether the worker takes requests, and its load."""

    ready: bool
    load: WorkerLoadReport
    role: str = ""  # the role it serves at the sample (a role switch changes it)


Sampler = Callable[[], Coroutine[None, None, WorkerSample]]  # run_coroutine_threadsafe's


def backend_sampler(backend: WorkerBackend, state: ServingState) -> Sampler:
    """A sample of ``backend`` as ``GetLoad`` and the standard health answer see it."""

    async def sample() -> WorkerSample:
        health = backend.health()
        return WorkerSample(health.ready and not state.closed, await backend.load(),
                            health.role)

    return sample


class WorkerCollector(Collector):
    """The ``pdserve:*`` worker metrics. ``collect`` runs on the HTTP server's thread
    and takes its sample on ``loop`` (where the backend lives), within ``deadline_s``;
    a sample that is late or fails leaves the last one in place."""

    def __init__(self, health: WorkerHealth, sampler: Sampler,
                 loop: asyncio.AbstractEventLoop, deadline_s: float = SCRAPE_DEADLINE_S
                 ) -> None:
        self._labels = [health.model, health.role, health.transport]
        self._info = {"worker_id": health.worker_id, "role": health.role,
                      "model_name": health.model, "transport": health.transport,
                      "version": version()}
        self._sampler = sampler
        self._loop = loop
        self._deadline_s = deadline_s
        self._last = WorkerSample(False, WorkerLoadReport(), health.role)

    def sample(self) -> WorkerSample:
        try:
            self._last = self._sample_on_loop()
        except TimeoutError:
            logger.warning("metrics: worker sample late (> %.1f s), reporting the last",
                           self._deadline_s)
        except Exception as exc:  # noqa: BLE001 - a scrape reports the last sample instead
            logger.warning("metrics: worker sample failed (reporting the last): %s", exc)
        return self._last

    def _sample_on_loop(self) -> WorkerSample:
        future = asyncio.run_coroutine_threadsafe(self._sampler(), self._loop)
        try:
            return future.result(timeout=self._deadline_s)
        finally:
            future.cancel()  # a no-op once it is done

    def collect(self) -> Iterator[Metric]:
        sample = self.sample()
        if sample.role and sample.role != self._info["role"]:  # its role was switched
            self._info["role"] = self._labels[1] = sample.role
        info = GaugeMetricFamily("pdserve:worker_info", "This worker process (value 1)",
                                 labels=list(self._info))
        info.add_metric(list(self._info.values()), 1)
        yield info
        ready = GaugeMetricFamily("pdserve:worker_ready", "1 while the worker takes "
                                  "requests (engine ready, not draining)", labels=LABELS)
        ready.add_metric(self._labels, 1 if sample.ready else 0)
        yield ready
        for name, doc, value in _COUNTERS:
            counter = CounterMetricFamily(name, doc, labels=LABELS)
            counter.add_metric(self._labels, value(sample.load))
            yield counter
        for name, doc, value in _GAUGES:
            gauge = GaugeMetricFamily(name, doc, labels=LABELS)
            gauge.add_metric(self._labels, value(sample.load))
            yield gauge


class _GlobalMetrics(Collector):
    """prometheus_client's global registry: vLLM's ``vllm:*`` metrics, the process's."""

    def collect(self) -> Iterator[Metric]:
        yield from REGISTRY.collect()


class MetricsServer:
    """A started ``/metrics`` listener (its own thread); ``close`` stops it."""

    def __init__(self, httpd: WSGIServer, thread: threading.Thread, endpoint: str) -> None:
        self._httpd = httpd
        self._thread = thread
        self.endpoint = endpoint

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @classmethod
    def start(cls, listener: MetricsListener, collector: Collector) -> MetricsServer:
        registry = CollectorRegistry()
        registry.register(_GlobalMetrics())
        registry.register(collector)
        try:
            httpd, thread = start_http_server(listener.port, listener.host, registry=registry)
        except OSError as exc:
            raise RuntimeError(f"cannot bind metrics port {listener.host}:{listener.port}: "
                               f"{exc}") from None
        return cls(httpd, thread, listener.endpoint)

    def close(self) -> None:
        """Stop serving (waits for a scrape in progress, which has its deadline)."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=SCRAPE_DEADLINE_S + 1)


def start_worker_metrics(listener: MetricsListener, backend: WorkerBackend,
                         state: ServingState) -> MetricsServer | None:
    """Serve ``backend``'s metrics on ``listener`` (call on the worker's event loop);
    None when its port is 0 (off)."""
    if not listener.port:
        return None
    collector = WorkerCollector(backend.health(), backend_sampler(backend, state),
                                asyncio.get_running_loop())
    server = MetricsServer.start(listener, collector)
    logger.info("metrics on http://%s:%d/metrics", listener.host, server.port)
    return server
