"""The router's LoRA fan-out over real gRPC to scripted workers: a load reaches every
worker and a worker that joins later or lost it (replayed before it is placed on), a
folder every worker refuses is not kept, an unload reaches them all."""

from __future__ import annotations

import httpx
import pytest
from unit.fake_worker import start_fake_worker

from pdserve.core.lora import LoraAdapter
from pdserve.membership.static import static_infos
from pdserve.router.dispatch.lora_catalog import LoraCatalog, LoraRefusedError
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
        assert late.servicer.loras == {"sql": SQL}  # replayed at its health check
        (joined,) = [w for w in pool.decode if w.info == info]
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
        assert other.servicer.loras == {"sql": SQL}
        assert all(w.snapshot().serves("sql") for w in pool.decode)
    finally:
        await pool.close()
        for worker in (decode, other):
            await worker.stop()


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
