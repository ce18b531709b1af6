"""The router's LoRA fan-out over real gRPC to scripted workers: a load reaches every
worker and a worker that joins later or lost it (replayed before it is placed on), a
folder every worker refuses is not kept, an unload reaches them all."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from unit.fake_worker import WorkerScript, eventually, start_fake_worker

from pdserve.core.lora import LoraAdapter
from pdserve.membership.static import static_infos
from pdserve.router.dispatch.lora_catalog import (
    LoraCatalog,
    LoraNotLoadedError,
    LoraRefusedError,
)
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.http.admin.app import create_admin_app
from pdserve.router.http.admin.loras import lora_actions

SQL = LoraAdapter("sql", "/adapters/sql")


async def test_loads_and_unloads_reach_every_worker_and_later_ones() -> None:
    prefill, decode = await start_fake_worker("prefill"), await start_fake_worker("decode")
    late = await start_fake_worker("decode")
    pool = WorkerPool([prefill.endpoint], [decode.endpoint])
    catalog = LoraCatalog(pool)
    try:
        await pool.refresh_all()
        assert catalog.adapter("sql") is None and catalog.adapters() == []
        outcome = await catalog.load(SQL)
        assert sorted(outcome.workers.values()) == ["loaded", "loaded"]
        assert prefill.servicer.loras == decode.servicer.loras == {"sql": SQL}
        assert catalog.adapter("sql") == SQL and catalog.adapters() == [SQL]
        assert all(w.snapshot().serves("sql") for w in pool.all)

        with pytest.raises(LoraRefusedError, match="no such folder"):
            await catalog.load(LoraAdapter("chat", "/bad/chat"))
        assert catalog.adapter("chat") is None  # nothing kept

        (info,) = static_infos((), [late.endpoint])
        await pool.put(info)
        await pool.refresh_all()
        (joined,) = [w for w in pool.decode if w.info == info]
        await joined.lora_replayed()  # replayed after its health check
        assert late.servicer.loras == {"sql": SQL}
        assert joined.snapshot().healthy and joined.snapshot().serves("sql")

        outcome = await catalog.unload("sql")
        assert sorted(outcome.workers.values()) == ["unloaded"] * 3
        assert not (prefill.servicer.loras or decode.servicer.loras or late.servicer.loras)
        assert not any(w.snapshot().serves("sql") for w in pool.all)
        with pytest.raises(KeyError):
            await catalog.unload("sql")
    finally:
        await pool.close()
        for worker in (prefill, decode, late):
            await worker.stop()


async def test_a_worker_that_lost_an_adapter_gets_it_back_at_its_next_check() -> None:
    decode, other = await start_fake_worker("decode"), await start_fake_worker("decode")
    pool = WorkerPool((), [decode.endpoint, other.endpoint])
    catalog = LoraCatalog(pool)
    try:
        await pool.refresh_all()
        await catalog.load(SQL)
        await other.servicer.unload_lora("sql")  # lost it (a restart, say)
        assert other.servicer.loras == {}
        await pool.refresh_all()
        for worker in pool.decode:
            await worker.lora_replayed()
        assert other.servicer.loras == {"sql": SQL}
        assert all(w.snapshot().serves("sql") for w in pool.decode)
    finally:
        await pool.close()
        for fake in (decode, other):
            await fake.stop()


async def test_the_admin_routes_answer_as_vllm_does() -> None:
    """vLLM's bodies on the admin plane, behind its key; a bad folder is 400 and an
    unknown adapter 404 in OpenAI's error JSON."""
    decode = await start_fake_worker("decode")
    pool = WorkerPool((), [decode.endpoint])
    app = create_admin_app(None, lora_actions(LoraCatalog(pool), "m"), keys=("adm-key-1",))
    auth = {"Authorization": "Bearer adm-key-1"}
    try:
        await pool.refresh_all()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://admin") as http:
            body = {"lora_name": "sql", "lora_path": SQL.path}
            assert (await http.post("/v1/load_lora_adapter", json=body)).status_code == 401
            ok = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
            assert ok.status_code == 200 and ok.json()["workers"] == {
                decode.servicer.worker_id: "loaded"}
            assert ok.json()["lora_tag"] == SQL.tag  # what the responses' spans name
            again = await http.post("/v1/load_lora_adapter", json=body, headers=auth)
            assert again.status_code == 200  # the same folder again: nothing to do
            inplace = await http.post("/v1/load_lora_adapter", headers=auth,
                                      json={**body, "load_inplace": True})
            assert inplace.status_code == 409  # a rewritten folder: new weights, old keys
            assert inplace.json()["error"]["code"] == "lora_folder_unchanged"
            for bad, param in (({"lora_name": "x", "lora_path": "/bad/x"}, "lora_path"),
                               ({"lora_name": "m", "lora_path": "/a/m"}, "lora_name")):
                refused = await http.post("/v1/load_lora_adapter", json=bad, headers=auth)
                assert refused.status_code == 400
                assert refused.json()["error"]["param"] == param
            gone = await http.post("/v1/unload_lora_adapter", json={"lora_name": "nope"},
                                   headers=auth)
            assert gone.status_code == 404
            assert gone.json()["error"]["code"] == "model_not_found"
            unloaded = await http.post("/v1/unload_lora_adapter", json={"lora_name": "sql"},
                                       headers=auth)
            assert unloaded.status_code == 200 and decode.servicer.loras == {}
    finally:
        await pool.close()
        await decode.stop()


async def test_a_load_no_worker_took_is_an_error_and_not_kept() -> None:
    """No worker (or only workers with LoRA off) took it: 503, nothing kept, nothing
    replayed; a worker with LoRA off is not called again at each check."""
    off = await start_fake_worker("decode", WorkerScript(lora_off=True))
    empty = LoraCatalog(WorkerPool((), ()))
    pool = WorkerPool((), [off.endpoint])
    catalog = LoraCatalog(pool)
    try:
        with pytest.raises(LoraNotLoadedError, match="no workers"):
            await empty.load(SQL)
        await pool.refresh_all()
        with pytest.raises(LoraNotLoadedError, match="FAILED_PRECONDITION"):
            await catalog.load(SQL)
        assert catalog.adapter("sql") is None and not pool.lora_targets.loaded
        pool.lora_targets.on_loaded(SQL)  # as if another worker had taken it
        before = off.servicer.lora_calls
        await pool.refresh_all()
        (worker,) = pool.decode
        await worker.lora_replayed()
        assert off.servicer.lora_calls == before + 1  # tried once, then left alone
        await pool.refresh_all()
        await worker.lora_replayed()
        assert off.servicer.lora_calls == before + 1
        assert worker.snapshot().healthy and not worker.snapshot().serves("sql")
    finally:
        await pool.close()
        await off.stop()


async def test_a_slow_replay_does_not_hold_the_health_check() -> None:
    """The replay runs after the check: the worker is healthy (for the base model) while
    its adapter loads, and serves the adapter once loaded."""
    decode = await start_fake_worker("decode")
    pool = WorkerPool((), [decode.endpoint])
    gate = asyncio.Event()
    original = decode.servicer.load_lora

    async def slow_load(adapter: LoraAdapter) -> bool:
        await gate.wait()
        return await original(adapter)

    decode.servicer.load_lora = slow_load  # type: ignore[method-assign]
    try:
        pool.lora_targets.on_loaded(SQL)
        await asyncio.wait_for(pool.refresh_all(), 5)  # not held by the load
        (worker,) = pool.decode
        assert worker.snapshot().healthy and not worker.snapshot().serves("sql")
        gate.set()
        await worker.lora_replayed()
        assert worker.snapshot().serves("sql")
    finally:
        await pool.close()
        await decode.stop()


async def test_a_probe_during_a_refit_never_brings_back_the_old_folder() -> None:
    """The refit's target is set before its fan-out: a worker that took the new folder
    while another still loads it is not replayed back to the old one."""
    slow, fast = await start_fake_worker("decode"), await start_fake_worker("decode")
    pool = WorkerPool((), [slow.endpoint, fast.endpoint])
    catalog = LoraCatalog(pool)
    new = LoraAdapter("sql", "/adapters/sql-2")
    gate = asyncio.Event()
    original = slow.servicer.load_lora

    async def gated(adapter: LoraAdapter) -> bool:
        if adapter == new:
            await gate.wait()
        return await original(adapter)

    slow.servicer.load_lora = gated  # type: ignore[method-assign]
    try:
        await pool.refresh_all()
        await catalog.load(SQL)
        refit = asyncio.create_task(catalog.load(new))
        await eventually(lambda: fast.servicer.loras == {"sql": new}, what="fast took it")
        assert catalog.adapter("sql") == SQL  # no snapshot has the new folder yet
        await pool.refresh_all()  # a probe while the slow one still loads
        assert catalog.adapter("sql") == new  # the fast one serves it now
        gate.set()
        await refit
        for worker in pool.decode:
            await worker.lora_replayed()
        assert slow.servicer.loras == fast.servicer.loras == {"sql": new}
        assert catalog.adapter("sql") == new
    finally:
        gate.set()
        await pool.close()
        for fake in (slow, fast):
            await fake.stop()


async def test_an_unload_stops_routing_to_the_adapter_before_its_fan_out() -> None:
    decode = await start_fake_worker("decode")
    pool = WorkerPool((), [decode.endpoint])
    catalog = LoraCatalog(pool)
    gate = asyncio.Event()
    original = decode.servicer.unload_lora

    async def draining(name: str) -> bool:
        await gate.wait()  # the worker drains the adapter's running requests
        return await original(name)

    decode.servicer.unload_lora = draining  # type: ignore[method-assign]
    try:
        await pool.refresh_all()
        await catalog.load(SQL)
        assert catalog.adapter("sql") == SQL
        unloading = asyncio.create_task(catalog.unload("sql"))
        await eventually(lambda: catalog.adapter("sql") is None, what="routing stopped")
        assert not unloading.done() and catalog.adapters() == []  # still draining
        gate.set()
        await unloading
        assert decode.servicer.loras == {}
    finally:
        gate.set()
        await pool.close()
        await decode.stop()
