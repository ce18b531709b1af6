"""A request's exact LoRA adapter (name and folder) through the dispatcher, on scripted
gRPC workers: placed only on workers serving that folder, a worker that serves the name
from another folder (a refit half done) refuses it ABORTED and the request goes on
elsewhere, the n>1 sibling follows only a worker serving it; through vLLM's RL refit
(pause, load a new folder, resume) a request held at the gate runs the new folder and a
kept one whose tokens went out ends ``abort``. The cluster fixture's leak check runs
after each test."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from unit.dispatch_cluster import PROMPT, Cluster, collect, running_cluster, spec, tokens
from unit.fake_worker import FakeWorkerServicer

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import SamplingSpec
from pdserve.router.dispatch.base import NoWorkerAvailableError
from pdserve.router.dispatch.lora_catalog import refit_folder
from pdserve.router.dispatch.workers.breaker import BreakerConfig, CircuitBreaker
from pdserve.router.dispatch.workers.pool import Worker

SQL = LoraAdapter("sql", "/adapters/sql")
SQL2 = LoraAdapter("sql", "/adapters/sql-2")  # the same name, another folder: a refit
MIGRATIONS = "pdserve:migrations_total"


def under(adapter: LoraAdapter, max_tokens: int = 4) -> SamplingSpec:
    return replace(spec(max_tokens), lora_name=adapter.name, lora_path=adapter.path)


def serving(c: Cluster, decode_adapters: tuple[LoraAdapter, ...]) -> list[Worker]:
    """The prefill serves SQL, the decodes (pool order) ``decode_adapters``."""
    c.p.loras = {"sql": SQL}
    by_endpoint = {d.endpoint: d.servicer for d in c.decodes}
    workers = list(c.pool.decode)
    for worker, adapter in zip(workers, decode_adapters, strict=True):
        by_endpoint[worker.snapshot().endpoint].loras = {adapter.name: adapter}
    return workers


def servicer_of(c: Cluster, worker: Worker) -> FakeWorkerServicer:
    return {d.endpoint: d.servicer for d in c.decodes}[worker.snapshot().endpoint]


async def test_requests_go_only_where_their_exact_folder_is_served() -> None:
    async with running_cluster(num_decode=2) as c:
        old, new = serving(c, (SQL, SQL2))
        await c.pool.refresh_all()
        for i in range(4):  # round robin would use both
            chunks = await collect(c.dispatcher.generate(f"r{i}", PROMPT, under(SQL2)))
            assert len(tokens(chunks)) == 4
        assert servicer_of(c, old).generates == []
        assert len(servicer_of(c, new).generates) == 4
        assert c.p.generates == []  # the prefill serves the old folder: decode alone
        for d in c.decodes:
            d.servicer.loras.clear()
        await c.pool.refresh_all()
        with pytest.raises(NoWorkerAvailableError):
            await collect(c.dispatcher.generate("r9", PROMPT, under(SQL2)))


async def test_a_worker_on_another_folder_refuses_and_the_request_goes_on_elsewhere(
) -> None:
    """Its snapshot still says the old folder (a refit landed since): it refuses ABORTED,
    the request is continued on the other worker, whole."""
    async with running_cluster(num_decode=2) as c:
        first, second = serving(c, (SQL, SQL))
        await c.pool.refresh_all()
        servicer_of(c, first).loras = {"sql": SQL2}  # refit there; no probe since
        before = c.registry.get_sample_value(MIGRATIONS, {"reason": "aborted"}) or 0.0
        chunks = await collect(c.dispatcher.generate("r1", PROMPT, under(SQL)))
        assert len(tokens(chunks)) == 4 and chunks[-1].finish_reason == "length"
        assert servicer_of(c, first).lora_refusals == 1
        assert len(servicer_of(c, second).generates) == 1
        assert c.registry.get_sample_value(MIGRATIONS, {"reason": "aborted"}) == before + 1
        assert first.snapshot().healthy


async def test_the_sibling_follows_only_a_worker_serving_its_folder() -> None:
    async with running_cluster(num_decode=2) as c:
        old, new = serving(c, (SQL, SQL2))
        await c.pool.refresh_all()
        affinity = old.snapshot().worker_id
        chunks = await collect(c.dispatcher.generate("r1", PROMPT, under(SQL2),
                                                     affinity=affinity))
        assert len(tokens(chunks)) == 4
        assert servicer_of(c, old).generates == []
        chunks = await collect(c.dispatcher.generate("r2", PROMPT, under(SQL),
                                                     affinity=affinity))
        assert len(servicer_of(c, old).generates) == 1  # it serves that one: followed


def test_a_refusal_for_another_folder_does_not_count_against_the_worker() -> None:
    breaker = CircuitBreaker(BreakerConfig(threshold=1, base_backoff_s=1, max_backoff_s=1))
    assert not breaker.on_failure("ABORTED") and breaker.num_failures == 0
    assert breaker.on_failure("INTERNAL")  # a failure of the worker's own still does


async def test_a_request_held_through_pause_load_resume_runs_the_new_folder() -> None:
    """vLLM's RL refit (``/pause``, ``load_lora_adapter`` with a new folder, ``/resume``):
    a request that waited at the closed gate runs the folder served when it is admitted,
    not the one gone while it waited (before: 503, no worker serves it)."""
    async with running_cluster(num_decode=1) as c:
        serving(c, (SQL,))
        await c.pool.refresh_all()
        c.dispatcher.weights.pause()
        held = asyncio.create_task(collect(c.dispatcher.generate("r1", PROMPT, under(SQL))))
        await asyncio.sleep(0.1)
        assert not held.done()
        c.p.loras = {"sql": SQL2}
        c.decodes[0].servicer.loras = {"sql": SQL2}
        await c.pool.refresh_all()
        c.dispatcher.weights.resume()
        chunks = await asyncio.wait_for(held, 10)
        assert len(tokens(chunks)) == 4 and chunks[-1].finish_reason == "length"
        assert c.decodes[0].servicer.lora_refusals == 0 and c.p.lora_refusals == 0


async def test_refit_folder_keeps_the_exact_folder_while_served_then_moves_to_the_new_one(
) -> None:
    async with running_cluster(num_decode=1) as c:
        serving(c, (SQL,))
        await c.pool.refresh_all()
        loras = c.dispatcher.loras
        assert refit_folder(under(SQL), loras) == under(SQL)
        assert refit_folder(spec(4), loras) == spec(4)  # no adapter
        c.decodes[0].servicer.loras = {"sql": SQL2}  # the prefill still serves SQL
        await c.pool.refresh_all()
        assert refit_folder(under(SQL), loras) == under(SQL)  # exact, while served
        c.p.loras = {"sql": SQL2}
        await c.pool.refresh_all()
        assert refit_folder(under(SQL), loras) == under(SQL2)  # the new folder


async def test_a_kept_request_goes_on_under_the_new_folder_and_its_chunks_say_where(
) -> None:
    """``/pause?mode=keep`` then a refit to a new folder: the kept request had sent its
    first token under the old folder, which no worker serves after: it goes on under the
    new folder from the tokens sent, and its chunks name each folder where it starts (the
    response's ``usage.weight_versions`` spans, ``lora``)."""
    async with running_cluster(num_decode=1) as c:
        serving(c, (SQL,))
        await c.pool.refresh_all()
        decode = c.decodes[0].servicer
        decode.script.decode_gate = asyncio.Event()  # decode holds after prefill's token
        running = asyncio.create_task(collect(c.dispatcher.generate("r1", PROMPT,
                                                                    under(SQL, 8))))
        await asyncio.sleep(0.2)
        c.dispatcher.weights.pause()
        (ticket,) = c.dispatcher.weights.abort(None, keep=True)
        assert ticket.sent
        decode.ended.set()  # the worker ends the frozen decode
        c.p.loras = {"sql": SQL2}
        decode.loras = {"sql": SQL2}
        await c.pool.refresh_all()
        decode.script.decode_gate = None
        c.dispatcher.weights.resume()
        chunks = await asyncio.wait_for(running, 10)
        assert len(tokens(chunks)) == 8 and chunks[-1].finish_reason == "length"
        named = [(i, ch.adapter) for i, ch in enumerate(chunks) if ch.adapter]
        assert [tag for _, tag in named] == [SQL.tag, SQL2.tag]
        switched = sum(len(ch.token_ids) for ch in chunks[:named[1][0]])
        assert switched == 1  # the old folder's one token, then the new folder's
        assert decode.lora_refusals == 0


def test_the_spans_split_where_the_version_or_the_adapter_folder_changes() -> None:
    from pdserve.router.http.openai.request_output import RequestOutput

    out = RequestOutput.__new__(RequestOutput)  # the span bookkeeping alone
    out.weight_spans = []
    out._span(None, 1)  # no worker named a version: no span
    assert out.weight_spans == []
    out._span("v1", 2, SQL.tag)
    out._span(None, 3)  # more of the same
    out._span("v1", 1, SQL2.tag)  # a kept request on the refitted folder
    out._span(None, 2)
    out._span("v2", 1)  # a weight refit: the folder stays
    assert out.weight_spans == [["v1", 0, 5, SQL.tag], ["v1", 5, 8, SQL2.tag],
                                ["v2", 8, 9, SQL2.tag]]
