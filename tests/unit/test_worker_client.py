"""The router's gRPC adapter (``router/dispatch/workers/client.py``) against a simulated worker:
domain types out, a typed error carrying the status code's name, and the blocking
probes the launcher, tests and benchmarks use."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from unit.sim_cluster import start_sim_worker

from pdserve.core.ports import free_port
from pdserve.core.types import PhaseRequest, SamplingSpec, WorkerHealth, WorkerLoadReport
from pdserve.router.dispatch.workers.client import (
    UNAVAILABLE,
    WorkerCallError,
    WorkerClient,
    probe_health,
    probe_load,
)
from pdserve.worker.sim.engine import SimConfig


async def test_client_speaks_domain_types() -> None:
    server, port, _ = await start_sim_worker(SimConfig("prefill", "p0", block_size=16))
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        health = await client.health(timeout_s=5)
        assert isinstance(health, WorkerHealth)
        assert (health.role, health.worker_id, health.ready) == ("prefill", "p0", True)
        assert isinstance(await client.load(timeout_s=5), WorkerLoadReport)
        request = PhaseRequest("r1", "prefill", tuple(range(40)), SamplingSpec(max_tokens=1))
        async with contextlib.aclosing(client.generate(request, timeout_s=5)) as outputs:
            (out,) = [o async for o in outputs]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        snap = await client.kv_snapshot(timeout_s=5)
        assert snap.worker_id == "p0" and snap.block_size == 16
    finally:
        await client.close()
        await server.stop(0)


async def test_unreachable_worker_is_a_typed_error_with_the_code_name() -> None:
    client = WorkerClient(f"127.0.0.1:{free_port()}")
    try:
        with pytest.raises(WorkerCallError) as err:
            await client.health(timeout_s=2)
        assert err.value.code == UNAVAILABLE
        with pytest.raises(WorkerCallError, match=UNAVAILABLE):
            await client.abort("r1", timeout_s=2)
    finally:
        await client.close()


async def test_blocking_probes() -> None:
    server, port, _ = await start_sim_worker(SimConfig("decode", "d0", block_size=16))
    try:
        endpoint = f"127.0.0.1:{port}"
        health = await asyncio.to_thread(probe_health, endpoint, 5)
        assert (health.role, health.worker_id) == ("decode", "d0")
        load = await asyncio.to_thread(probe_load, endpoint, 5)
        assert load.num_running_reqs == 0 and load.kv_loads == 0
    finally:
        await server.stop(0)
    with pytest.raises(WorkerCallError) as err:
        await asyncio.to_thread(probe_load, f"127.0.0.1:{free_port()}", 2)
    assert err.value.code == UNAVAILABLE
