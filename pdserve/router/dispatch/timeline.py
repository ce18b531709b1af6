"""One request's timeline through the cluster, and where it is recorded.

A ``RequestTimeline`` is created when the router receives a request (``serving.py``) and
threaded through the dispatcher, which marks the router's own steps (placed, first call
sent) and hands it each worker output. The workers' ``PhaseTiming`` (on each call's last
output) supplies the engine-side phases; the router's clock supplies its own phase and
the decode steps. When the request finishes, ``TimelineRecorder`` observes every phase
in ``pdserve:request_phase_seconds{phase}``, the KV handoff's load time and tokens per
transport (``pdserve:kv_handoff_load_seconds{transport}``,
``pdserve:kv_handoff_tokens_total{transport}``: what the router sees of a transfer; the
bytes are the workers' ``pdserve:kv_transfer_bytes_*``) and, when logger
``pdserve.timeline`` is at DEBUG (``--log-timeline``), logs the whole timeline as one
JSON line. With metrics off (no registry) only the log line remains.

Phases (seconds; a phase whose source is missing is left out, never recorded as 0):

  router           received -> first worker call sent (validation, tokenization, placement)
  prefill_queue    prefill engine: queued -> scheduled
  prefill_compute  prefill engine: scheduled -> first token
  handoff          prefill's first token out -> decode worker admitted the call (wall
                   clocks of two workers: exact on one machine, NTP-close across machines)
  kv_load          decode: loading the prompt's KV (see ``PhaseTiming.kv_load_ns``)
  decode_queue     decode engine: queued -> scheduled, less the KV load
  decode_step      the mean time between decode tokens, as the router receives them
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry

from pdserve.core.types import PhaseOutput, PhaseTiming
from pdserve.kv_transfer.base import transport_names
from pdserve.router.metrics import PREFIX, counter, histogram

logger = logging.getLogger("pdserve.timeline")

PHASES = ("router", "prefill_queue", "prefill_compute", "handoff", "kv_load", "decode_queue",
          "decode_step")
_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
            1.0, 2.5, 5.0, 10.0, 30.0)
_NS = 1e-9


class RequestTimeline:
    """Mutable, owned by the one task serving the request; per-chunk marks are a clock
    read and two additions."""

    __slots__ = ("request_id", "arrival_s", "first_call_s", "prefill", "decode",
                 "first_decode_s", "last_decode_s", "num_decode_steps", "num_migrations",
                 "transport", "num_kv_tokens")

    def __init__(self, request_id: str, arrival_s: float | None = None) -> None:
        self.request_id = request_id
        self.arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self.first_call_s = 0.0
        self.prefill: PhaseTiming | None = None
        self.decode: PhaseTiming | None = None
        self.first_decode_s = 0.0
        self.last_decode_s = 0.0
        self.num_decode_steps = 0  # tokens received after decode's first output
        self.num_migrations = 0  # decode workers replaced mid-request (migration.py)
        self.transport = ""  # the KV handle's, when prefill handed one over
        self.num_kv_tokens = 0

    def on_call(self) -> None:
        """A worker call is about to go out; only the first one ends the router phase."""
        if not self.first_call_s:
            self.first_call_s = time.perf_counter()

    def on_prefill(self, out: PhaseOutput) -> None:
        self.prefill = out.timing
        if out.kv_handle is not None:
            self.transport = out.kv_handle.transport
            self.num_kv_tokens = out.kv_handle.num_tokens

    def on_decode(self, num_tokens: int, timing: PhaseTiming | None = None) -> None:
        """A decode output of ``num_tokens`` arrived; ``timing``: the call's, on its last."""
        now = time.perf_counter()
        if not self.first_decode_s:
            self.first_decode_s = now
        else:
            self.num_decode_steps += num_tokens
        self.last_decode_s = now
        if timing is not None:
            self.decode = timing

    def on_migrated(self) -> None:
        """Decode moved to another worker: the handoff from prefill is no longer the one
        that decode's timing (the last worker's) measures, so it is left out."""
        self.num_migrations += 1

    def phases(self) -> dict[str, float]:
        """Every phase this request has a measure of, in seconds."""
        out: dict[str, float] = {}
        if self.first_call_s:
            out["router"] = self.first_call_s - self.arrival_s
        p, d = self.prefill, self.decode
        if p is not None:
            out["prefill_queue"] = p.queue_ns * _NS
            out["prefill_compute"] = p.compute_ns * _NS
        if p is not None and d is not None:
            if p.first_token_unix_ns and d.admitted_unix_ns and not self.num_migrations:
                out["handoff"] = max(d.admitted_unix_ns - p.first_token_unix_ns, 0) * _NS
            out["kv_load"] = d.kv_load_ns * _NS
        if d is not None:
            out["decode_queue"] = max(d.queue_ns - d.kv_load_ns, 0) * _NS
        if self.num_decode_steps:
            out["decode_step"] = ((self.last_decode_s - self.first_decode_s)
                                  / self.num_decode_steps)
        return out


class TimelineRecorder:
    """The phase and KV handoff metrics (phase children looked up once) and the
    per-request log line."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        histogram_ = histogram(
            registry, f"{PREFIX}request_phase_seconds", "Where finished requests spent their "
            "time, by phase (router, prefill_queue, prefill_compute, handoff, kv_load, "
            "decode_queue, decode_step: the mean time between decode tokens).", ["phase"],
            _BUCKETS)
        self._children = {phase: histogram_.labels(phase) for phase in PHASES}
        self._kv_seconds = histogram(
            registry, f"{PREFIX}kv_handoff_load_seconds", "Decode's load of the prompt's KV "
            "handed over by prefill (its PhaseTiming.kv_load_ns), by the handle's transport.",
            ["transport"], _BUCKETS)
        self._kv_tokens = counter(
            registry, f"{PREFIX}kv_handoff_tokens", "Prompt tokens whose KV prefill handed "
            "to decode, by the handle's transport.", ["transport"])
        for transport in transport_names():  # at 0 from start-up, not from the first handoff
            self._kv_seconds.labels(transport)
            self._kv_tokens.labels(transport)
        self._enabled = registry is not None

    def record(self, timeline: RequestTimeline) -> None:
        if self._enabled:
            self._observe(timeline, timeline.phases())
        if logger.isEnabledFor(logging.DEBUG):
            phases = timeline.phases()
            logger.debug("%s", json.dumps({
                "request_id": timeline.request_id, "num_decode_steps": timeline.num_decode_steps,
                "num_migrations": timeline.num_migrations,
                "phases_ms": {k: round(v * 1e3, 3) for k, v in phases.items()}}))

    def _observe(self, timeline: RequestTimeline, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self._children[phase].observe(seconds)
        if timeline.transport and "kv_load" in phases:
            self._kv_seconds.labels(timeline.transport).observe(phases["kv_load"])
            self._kv_tokens.labels(timeline.transport).inc(timeline.num_kv_tokens)
