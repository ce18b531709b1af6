"""``pdserve bench`` computes what ``vllm bench serve`` computes: its own functions
(``vllm.benchmarks.serve.calculate_metrics`` and ``get_request``), run on the same inputs,
give the same numbers. pdserve re-implements them rather than importing them (see
``pdserve/bench/__init__.py``); this test keeps the two equal. Importing vLLM's module
imports vLLM: it is imported by the ``serve`` fixture, in the one test process that runs
these tests (at module level, every unit-test process paid ~6 s of CPU for it while
collecting)."""

from __future__ import annotations

import asyncio
import importlib
from types import ModuleType

import numpy as np
import pytest

from pdserve.bench.load.metrics import RequestRecord, Slo, summarize
from pdserve.bench.workload.arrivals import arrival_times


@pytest.fixture(scope="module")
def serve() -> ModuleType:
    return importlib.import_module("vllm.benchmarks.serve")


def _records() -> list[RequestRecord]:
    rng = np.random.RandomState(11)
    records = []
    for i in range(40):
        num_out = int(rng.randint(1, 12))
        itls = [float(x) for x in rng.uniform(0.01, 0.2, size=num_out - 1)]
        ttft = float(rng.uniform(0.05, 3.0))
        records.append(RequestRecord(int(rng.randint(5, 900)), num_out, 0, ttft,
                                     ttft + sum(itls), itls, float(i), None))
    records.append(RequestRecord(10, 5, 0, 0.5, 1.5, [0.25] * 4, 50.0))  # at the SLO edge
    records.append(RequestRecord(10, error="http_500"))
    return records


def test_metrics_equal_vllm_calculate_metrics(serve: ModuleType) -> None:
    records, duration = _records(), 37.5
    outputs = [serve.RequestFuncOutput(
        success=r.error is None, latency=r.e2e_s or 0.0, output_tokens=r.output_tokens,
        ttft=r.ttft_s or 0.0, itl=r.itls_s, prompt_len=r.prompt_tokens, start_time=r.start_s,
        error=r.error or "") for r in records]
    ours = summarize(records, duration, Slo.parse("ttft=500ms,tpot=250ms,e2e=1500ms"))
    theirs, _ = serve.calculate_metrics([], outputs, duration, None, [50.0, 90.0, 99.0],
                                        {"ttft": 500.0, "tpot": 250.0, "e2el": 1500.0})
    assert (ours["completed"], ours["failed"]) == (theirs.completed, theirs.failed)
    assert (ours["input_tokens"], ours["output_tokens"]) == (theirs.total_input,
                                                             theirs.total_output)
    for key, name in (("request_throughput", "request_throughput"),
                      ("output_throughput", "output_throughput"),
                      ("total_token_throughput", "total_token_throughput"),
                      ("goodput", "request_goodput")):
        assert ours[key] == pytest.approx(getattr(theirs, name)), key
    assert ours["good"] > 0
    for ours_key, name in (("ttft_s", "ttft"), ("tpot_s", "tpot"), ("itl_s", "itl"),
                           ("e2e_s", "e2el")):
        assert ours[ours_key]["mean"] * 1e3 == pytest.approx(getattr(theirs, f"mean_{name}_ms"))
        assert ours[ours_key]["p50"] * 1e3 == pytest.approx(getattr(theirs, f"median_{name}_ms"))
        pcts = dict(getattr(theirs, f"percentiles_{name}_ms"))
        for p in (50, 90, 99):
            assert ours[ours_key][f"p{p}"] * 1e3 == pytest.approx(pcts[float(p)]), (name, p)


@pytest.mark.parametrize(("rate", "burstiness"), [(3.0, 1.0), (0.5, 0.3), (8.0, 5.0)])
def test_arrival_times_equal_vllm_get_request(monkeypatch: pytest.MonkeyPatch,
                                              serve: ModuleType, rate: float,
                                              burstiness: float) -> None:
    """vLLM's generator sleeps ``start + delay - now`` before each request: with its clock
    frozen at 0 the sleeps are the arrival times themselves."""
    sleeps: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def collect(n: int) -> int:
        return len([x async for x in serve.get_request(list(range(n)), rate, burstiness)])

    monkeypatch.setattr(serve.time, "time", lambda: 0.0)
    monkeypatch.setattr(serve.asyncio, "sleep", fake_sleep)
    np.random.seed(42)  # what vllm bench serve does with --seed
    n = 200
    assert asyncio.run(collect(n)) == n
    assert sleeps == pytest.approx(arrival_times(n, rate, burstiness, seed=42))
