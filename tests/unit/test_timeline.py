"""The per-request timeline (``router/timeline.py``) through the dispatcher and the
scripted workers: every phase lands in ``pdserve:request_phase_seconds`` with the
values the workers reported, and one JSON line per finished request is logged."""

from __future__ import annotations

import json
import logging
import time

import pytest
from unit.dispatch_cluster import PROMPT, Cluster, collect, spec

from pdserve.core.types import PhaseTiming
from pdserve.router.dispatch.timeline import PHASES, RequestTimeline

MS = 1_000_000
T0 = 1_700_000_000 * 10**9
# Prefill: queued 2 ms, computed 3 ms, first token out at T0 + 5 ms. Decode admitted 7 ms
# later, 4 ms in its queue of which 1 ms loading KV.
PREFILL = PhaseTiming(T0, T0 + 5 * MS, 2 * MS, 3 * MS, 0)
DECODE = PhaseTiming(T0 + 12 * MS, T0 + 20 * MS, 4 * MS, 1 * MS, 1 * MS)
PHASE = "pdserve:request_phase_seconds"


def observed(cluster: Cluster, phase: str) -> tuple[float | None, float | None]:
    labels = {"phase": phase}
    return (cluster.registry.get_sample_value(f"{PHASE}_count", labels),
            cluster.registry.get_sample_value(f"{PHASE}_sum", labels))


async def test_a_finished_request_records_every_phase(cluster: Cluster) -> None:
    cluster.p.script.timing, cluster.d.script.timing = PREFILL, DECODE
    started = time.perf_counter()
    await collect(cluster.dispatcher.generate("r1", PROMPT, spec(5)))
    elapsed = time.perf_counter() - started
    want = {"prefill_queue": 0.002, "prefill_compute": 0.003, "handoff": 0.007,
            "kv_load": 0.001, "decode_queue": 0.003}
    for phase, seconds in want.items():
        count, total = observed(cluster, phase)
        assert count == 1 and total == pytest.approx(seconds), phase
    for phase in ("router", "decode_step"):  # the router's own clock: just measured
        count, total = observed(cluster, phase)
        # Within the request, however long a loaded machine made it take.
        assert count == 1 and total is not None and 0 <= total <= elapsed, phase


async def test_an_unfinished_request_records_nothing(cluster: Cluster) -> None:
    cluster.p.script.timing, cluster.d.script.timing = PREFILL, DECODE
    chunks = cluster.dispatcher.generate("r1", PROMPT, spec(5))
    await anext(chunks)
    await chunks.aclose()  # aborted: its timeline is partial
    assert all(observed(cluster, phase) == (0.0, 0.0) for phase in PHASES)


async def test_the_timeline_is_logged_as_one_json_line(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    cluster.p.script.timing, cluster.d.script.timing = PREFILL, DECODE
    with caplog.at_level(logging.DEBUG, logger="pdserve.timeline"):
        await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3),
                                                  RequestTimeline("r1")))
    (record,) = [r for r in caplog.records if r.name == "pdserve.timeline"]
    line = json.loads(record.getMessage())
    assert line["request_id"] == "r1" and line["num_decode_steps"] == 1
    assert line["phases_ms"]["handoff"] == 7.0 and set(line["phases_ms"]) == set(PHASES)


async def test_no_log_line_unless_asked(
        cluster: Cluster, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pdserve.timeline"):
        await collect(cluster.dispatcher.generate("r1", PROMPT, spec(3)))
    assert not [r for r in caplog.records if r.name == "pdserve.timeline"]


def test_phases_without_a_source_are_left_out() -> None:
    """Workers that send no timing (older ones), a request decode computed alone."""
    timeline = RequestTimeline("r1", arrival_s=0.0)
    timeline.on_decode(1)
    assert timeline.phases() == {}
    timeline.on_call()
    timeline.on_decode(2, DECODE)
    assert set(timeline.phases()) == {"router", "decode_queue", "decode_step"}
