"""``pdserve bench router-cost --parts stream``'s pieces without processes: the CPU split
into per-token and per-request parts, the ITL window, the sweep's verdict, the config's
refusals, and the raw client against the stub engine (in this event loop)."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.bench.micro.router_cost import openai_stub
from pdserve.bench.micro.router_cost.stream import itl_limit_ms, verdict
from pdserve.bench.micro.router_cost.stream_client import (
    StreamResult,
    exchange,
    itls,
    pct,
    per_token_and_request,
    post_bytes,
    request_bytes,
    stream,
    stream_stats,
)
from pdserve.core.ports import free_port


def test_two_passes_split_cpu_into_per_token_and_per_request() -> None:
    per_request, per_token = 2e-3, 50e-6
    short = (100 * per_request + 200 * per_token, 200, 100)
    long = (48 * per_request + 9600 * per_token, 9600, 48)
    t, r = per_token_and_request(short, long)
    assert math.isclose(t, per_token) and math.isclose(r, per_request)
    with pytest.raises(ValueError, match="differ"):
        per_token_and_request((1.0, 20, 10), (2.0, 40, 20))


def test_itl_counts_only_gaps_inside_the_window() -> None:
    a = StreamResult(0.0, [1.0, 1.02, 1.04, 1.2], ok=True, ended=True)
    b = StreamResult(0.5, [0.6, 0.9], ok=True, ended=True)
    assert [round(g, 3) for g in itls([a, b], lo=1.0, hi=1.05)] == [0.02, 0.02]
    stats = stream_stats([a, b])
    assert stats["num_events"] == 6 and stats["num_failed"] == 0
    assert math.isclose(stats["max_gap_ms"], 300.0)
    assert math.isclose(stats["ttft_p50_ms"], 1000.0)  # nearest rank below of 100, 1000 ms
    assert math.isnan(pct([], 0.5))


def test_the_sweep_limit_is_the_engines_own_itl_or_the_pacing() -> None:
    cfg = RouterCostConfig(parts=("stream",), ms_per_token=20.0)
    step = {"num_failed": 0.0, "itl_p99_ms": 27.0, "direct_itl_p99_ms": 25.0,
            "router_saturated": 0.0, "router_cpu_pct": 50.0, "client_cpu_pct": 20.0}
    assert math.isclose(itl_limit_ms(step, cfg), 27.5) and verdict(step, cfg) == ""
    assert math.isclose(itl_limit_ms({**step, "direct_itl_p99_ms": 15.0}, cfg), 22.0)
    assert verdict({**step, "itl_p99_ms": 28.0}, cfg).startswith("ITL p99 28.0")
    assert verdict({**step, "direct_itl_p99_ms": 31.0}, cfg).startswith("busy")
    assert verdict({**step, "num_failed": 2.0}, cfg) == "2 failed"
    assert verdict({**step, "router_saturated": 1.0}, cfg) == "router CPU 50 %"
    assert verdict({**step, "client_cpu_pct": 95.0}, cfg) == "client CPU 95 %"


@pytest.mark.parametrize(("fields", "needle"), [
    ({"parts": ("latency", "nope")}, "unknown part(s) nope; valid: latency, stream"),
    ({"sweep_streams": (32, 16)}, "--sweep-streams must rise"),
    ({"stream_tokens": 2}, "--stream-tokens must be > 2"),
    ({"processes_list": (0,)}, "must be positive"),
])
def test_the_config_refuses_bad_values(fields: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValueError) as info:
        RouterCostConfig(**fields)
    assert needle in str(info.value)


def test_the_client_counts_every_event_the_stub_streams() -> None:
    async def scenario() -> tuple[StreamResult, dict[str, Any]]:
        port = free_port()
        server = asyncio.ensure_future(
            openai_stub.serve("127.0.0.1", port, openai_stub.Engine(1.0, 0.5)))
        try:
            for _ in range(100):  # until it listens
                try:
                    await exchange(port, b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n", 1)
                    break
                except OSError:
                    await asyncio.sleep(0.02)
            result = await stream(port, request_bytes(port, 25), 10)
            answer = await exchange(port, post_bytes(port, "/v1/completions",
                                                     {"max_tokens": 1}), 10)
        finally:
            server.cancel()
        return result, json.loads(answer.split(b"\r\n\r\n", 1)[1])

    result, answer = asyncio.run(scenario())
    assert result.ok and result.ended and len(result.stamps) == 25
    assert result.stamps == sorted(result.stamps) and result.stamps[0] >= result.start
    assert answer["kv_transfer_params"]["do_remote_prefill"] is True


def test_the_replicas_hit_rate_counts_both_clients_together() -> None:
    from pdserve.bench.micro.router_cost.replicas import hit_rate

    assert hit_rate([{"input_tokens": 100, "cached_tokens": 90},
                     {"input_tokens": 300, "cached_tokens": 150}]) == 240 / 400
    assert hit_rate([]) == 0.0
    with pytest.raises(ValueError, match="--replica-requests"):
        RouterCostConfig(parts=("replicas",), replica_requests=0)
