"""Runtime role switching without vLLM: the worker's side (``ServingState.switch_role``
over the servicer: drain, end past the timeout, switch, re-announce) on the scripted
fake worker; the router's side (``RoleSwitcher``: refusals, the pool filing the worker
under its new role, metrics) and the admin action over HTTP (``router/admin.py``:
keys, errors as OpenAI JSON). The same switch on real vLLM engines, with a stream
in flight: tests/integration/test_membership_etcd.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from prometheus_client import CollectorRegistry
from unit.fake_worker import FakeWorker, WorkerScript, eventually, start_fake_worker

from pdserve.core.types import PhaseOutput, PhaseRequest, SamplingSpec
from pdserve.router.cluster.errors import ClusterError
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.http.admin.actions import admin_actions
from pdserve.router.http.admin.app import create_admin_app
from pdserve.router.http.errors import to_api_error

CALL_S = 10.0


def request(request_id: str, phase: str = "decode", max_tokens: int = 3) -> PhaseRequest:
    return PhaseRequest(request_id, phase, (1, 2, 3), SamplingSpec(max_tokens=max_tokens))  # type: ignore[arg-type]


async def run(client: WorkerClient, req: PhaseRequest) -> list[PhaseOutput]:
    return [out async for out in client.generate(req, CALL_S)]


@contextlib.asynccontextmanager
async def gated_decode(**script: object) -> AsyncIterator[tuple[FakeWorker, asyncio.Event,
                                                               WorkerClient]]:
    gate = asyncio.Event()
    worker = await start_fake_worker("decode", WorkerScript(decode_gate=gate, **script))  # type: ignore[arg-type]
    client = WorkerClient(worker.endpoint)
    try:
        yield worker, gate, client
    finally:
        gate.set()
        await client.close()
        await worker.stop()


# ---- the worker's side ---------------------------------------------------------------


async def test_a_switch_lets_the_stream_in_flight_finish_then_serves_the_new_role() -> None:
    async with gated_decode() as (worker, gate, client):
        assert worker.serving is not None
        announced: list[str] = []

        async def announce() -> None:
            announced.append(worker.servicer.health().role)

        worker.serving.state.on_role_changed = announce
        stream = asyncio.create_task(run(client, request("r-old")))
        await eventually(lambda: "r-old" in worker.servicer.inflight, what="call in flight")
        switch = asyncio.create_task(client.set_role("prefill", 30.0, CALL_S))
        await eventually(lambda: worker.serving is not None and worker.serving.state.closed,
                         what="switch started")
        # While it switches: not ready, new calls refused (the router places elsewhere).
        assert not (await client.health(2.0)).ready
        with pytest.raises(WorkerCallError) as refused:
            await run(client, request("r-new"))
        assert refused.value.code == "UNAVAILABLE" and "switching" in refused.value.details
        assert not switch.done()  # the drain waits for the stream
        gate.set()
        outs = await stream
        assert [o.finish_reason for o in outs][-1] == "length" and len(outs) == 3
        result = await switch
        assert (result.role, result.changed, result.num_aborted) == ("prefill", True, 0)
        assert announced == ["prefill"] and worker.servicer.role_switches == ["prefill"]
        health = await client.health(2.0)
        assert (health.ready, health.role) == (True, "prefill")
        with pytest.raises(WorkerCallError) as wrong:
            await run(client, request("r-decode"))
        assert wrong.value.code == "FAILED_PRECONDITION"
        (first,) = await run(client, request("r-prefill", "prefill"))
        assert first.kv_handle is not None  # it serves prefill now


async def test_past_the_drain_timeout_streams_end_abort_and_leases_are_released() -> None:
    async with gated_decode() as (worker, _gate, client):
        stream = asyncio.create_task(run(client, request("r-stuck")))
        await eventually(lambda: "r-stuck" in worker.servicer.inflight, what="call in flight")
        result = await client.set_role("prefill", 0.2, CALL_S)
        assert (result.role, result.num_aborted) == ("prefill", 1)
        outs = await stream
        # An abort the router did not ask for: the router migrates the stream.
        assert outs[-1].finish_reason == "abort" and worker.servicer.aborts == ["r-stuck"]
        assert result.switch_ns >= 0.2e9


async def test_a_prefill_waits_for_its_leases_then_releases_what_is_left() -> None:
    worker = await start_fake_worker("prefill", WorkerScript(leases_pending=True))
    client = WorkerClient(worker.endpoint)
    try:
        (out,) = await run(client, request("r1", "prefill"))
        assert out.kv_handle is not None and worker.servicer.leases
        result = await client.set_role("decode", 0.2, CALL_S)
        assert (result.role, result.num_leases_released) == ("decode", 1)
        assert not worker.servicer.leases
    finally:
        await client.close()
        await worker.stop()


async def test_the_same_role_is_a_no_op_and_a_second_switch_is_refused() -> None:
    async with gated_decode() as (worker, gate, client):
        same = await client.set_role("decode", 1.0, CALL_S)
        assert (same.role, same.changed) == ("decode", False)
        stream = asyncio.create_task(run(client, request("r1")))
        await eventually(lambda: "r1" in worker.servicer.inflight, what="call in flight")
        first = asyncio.create_task(client.set_role("prefill", 30.0, CALL_S))
        await eventually(lambda: worker.serving is not None and worker.serving.state.closed)
        with pytest.raises(WorkerCallError) as second:
            await client.set_role("prefill", 1.0, CALL_S)
        assert second.value.code == "FAILED_PRECONDITION"
        gate.set()
        await stream
        assert (await first).changed
        assert worker.servicer.role_switches == ["prefill"]


async def test_a_draining_worker_refuses_a_switch() -> None:
    async with gated_decode() as (worker, _gate, client):
        assert worker.serving is not None
        await worker.serving.state.start_drain()
        with pytest.raises(WorkerCallError) as refused:
            await client.set_role("prefill", 1.0, CALL_S)
        assert refused.value.code == "UNAVAILABLE"
        assert worker.servicer.role_switches == []


# ---- the router's side ---------------------------------------------------------------


@contextlib.asynccontextmanager
async def pool_of(roles: tuple[str, ...]) -> AsyncIterator[tuple[WorkerPool,
                                                                list[FakeWorker]]]:
    workers = [await start_fake_worker(role) for role in roles]  # type: ignore[arg-type]
    pool = WorkerPool(prefill=[w.endpoint for w in workers if w.servicer.role == "prefill"],
                      decode=[w.endpoint for w in workers if w.servicer.role == "decode"])
    await pool.refresh_all()
    try:
        yield pool, workers
    finally:
        await pool.close()
        for w in workers:
            await w.stop()


async def test_the_router_files_a_switched_worker_under_its_new_role() -> None:
    async with pool_of(("prefill", "decode", "decode")) as (pool, workers):
        registry = CollectorRegistry()
        switcher = RoleSwitcher(pool, registry)
        added: list[tuple[str, str]] = []
        removed: list[tuple[str, str]] = []
        pool.on_worker_added(lambda s: added.append((s.worker_id, s.role)))
        pool.on_worker_removed(lambda s: removed.append((s.worker_id, s.role)))
        target = workers[2].servicer.worker_id
        outcome = await switcher.switch(target, "prefill", 1.0)
        assert (outcome.previous_role, outcome.result.role) == ("decode", "prefill")
        assert target in {w.snapshot().worker_id for w in pool.prefill}
        assert target not in {w.snapshot().worker_id for w in pool.decode}
        assert all(w.snapshot().healthy for w in pool.all)
        # Listeners (the prefix index's feeder) see it leave decode and join prefill.
        assert removed == [(target, "decode")] and added == [(target, "prefill")]
        assert registry.get_sample_value("pdserve:role_switches_total",
                                         {"role": "prefill", "outcome": "switched"}) == 1
        assert registry.get_sample_value("pdserve:role_switches_total",
                                         {"role": "decode", "outcome": "failed"}) == 0
        # And back: nothing else changed.
        await switcher.switch(target, "decode", 1.0)
        assert len(pool.prefill) == 1 and len(pool.decode) == 2


async def test_another_router_learns_the_new_role_from_health() -> None:
    async with pool_of(("prefill", "decode", "decode")) as (pool, workers):
        other = WorkerPool(decode=[workers[2].endpoint])
        try:
            await other.refresh_all()
            await RoleSwitcher(pool).switch(workers[2].servicer.worker_id, "prefill", 1.0)
            await other.refresh_all()
            assert [w.role for w in other.prefill] == ["prefill"] and other.decode == []
            assert other.prefill[0].snapshot().healthy
        finally:
            await other.close()


async def test_refusals_unknown_worker_last_decode_and_a_worker_already_switching() -> None:
    async with pool_of(("prefill", "decode")) as (pool, workers):
        registry = CollectorRegistry()
        switcher = RoleSwitcher(pool, registry)
        with pytest.raises(ClusterError) as unknown:
            await switcher.switch("nobody", "decode")
        assert (to_api_error(unknown.value).status_code, unknown.value.code) == (
            404, "worker_not_found")
        decode_id = workers[1].servicer.worker_id
        with pytest.raises(ClusterError) as last:
            await switcher.switch(decode_id, "prefill")
        assert (to_api_error(last.value).status_code, last.value.code) == (
            409, "last_decode_worker")
        assert workers[1].servicer.role_switches == []  # refused before any call
        pool.find(decode_id).begin_switch()  # type: ignore[union-attr]
        with pytest.raises(ClusterError) as busy:
            await switcher.switch(decode_id, "prefill", force=True)
        assert to_api_error(busy.value).status_code == 409
        pool.find(decode_id).end_switch(None)  # type: ignore[union-attr]
        forced = await switcher.switch(decode_id, "prefill", 1.0, force=True)
        assert forced.result.role == "prefill" and pool.decode == []
        refused = {role: registry.get_sample_value(
            "pdserve:role_switches_total", {"role": role, "outcome": "refused"})
            for role in ("prefill", "decode")}
        assert refused == {"prefill": 2, "decode": 1}


async def test_placement_skips_a_worker_while_this_router_switches_it() -> None:
    async with gated_decode() as (worker, gate, client):
        pool = WorkerPool(decode=[worker.endpoint])
        try:
            await pool.refresh_all()
            stream = asyncio.create_task(run(client, request("r1")))
            await eventually(lambda: "r1" in worker.servicer.inflight)
            switch = asyncio.create_task(
                RoleSwitcher(pool).switch(worker.servicer.worker_id, "prefill", 30.0,
                                          force=True))
            await eventually(lambda: pool.decode[0].switching if pool.decode else False)
            assert not pool.decode[0].snapshot().healthy
            gate.set()
            await stream
            await switch
            assert [w.role for w in pool.prefill] == ["prefill"]
            assert pool.prefill[0].snapshot().healthy and not pool.prefill[0].switching
        finally:
            await pool.close()


# ---- the admin action over HTTP ------------------------------------------------------


@contextlib.asynccontextmanager
async def admin_client(keys: tuple[str, ...] = (), host: str = "127.0.0.1"
                       ) -> AsyncIterator[tuple[httpx.AsyncClient, list[FakeWorker]]]:
    async with pool_of(("prefill", "decode", "decode")) as (pool, workers):
        app = create_admin_app(None, admin_actions(RoleSwitcher(pool)), keys=keys,
                               bind_host=host)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://admin") as http:
            yield http, workers


async def test_admin_action_switches_a_role_and_answers_errors_as_openai_json() -> None:
    async with admin_client() as (http, workers):
        target = workers[2].servicer.worker_id
        ok = await http.post(f"/admin/workers/{target}/role",
                             json={"role": "prefill", "drain_timeout_s": 1})
        assert ok.status_code == 200, ok.text
        assert ok.json()["role"] == "prefill" and ok.json()["previous_role"] == "decode"
        bad = await http.post(f"/admin/workers/{target}/role", json={"role": "both"})
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        unknown = await http.post("/admin/workers/nobody/role", json={"role": "decode"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "worker_not_found"


async def test_admin_action_needs_a_key_when_one_is_set_or_off_loopback() -> None:
    async with admin_client(keys=("admin-secret-1",)) as (http, workers):
        url = f"/admin/workers/{workers[2].servicer.worker_id}/role"
        missing = await http.post(url, json={"role": "prefill"})
        unread = await http.post(url, json={"role": "both"})  # the key first, then the body
        assert unread.status_code == 401
        wrong = await http.post(url, json={"role": "prefill"},
                                headers={"Authorization": "Bearer not-the-key"})
        assert (missing.status_code, wrong.status_code) == (401, 401)
        assert workers[2].servicer.role_switches == []
        ok = await http.post(url, json={"role": "prefill", "drain_timeout_s": 1},
                             headers={"Authorization": "Bearer admin-secret-1"})
        assert ok.status_code == 200
    async with admin_client(host="0.0.0.0") as (http, workers):
        closed = await http.post(f"/admin/workers/{workers[2].servicer.worker_id}/role",
                                 json={"role": "prefill"})
        assert closed.status_code == 403
        assert closed.json()["error"]["code"] == "admin_key_required"
