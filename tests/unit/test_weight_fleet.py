"""One refit for two router processes, on simulated workers over real gRPC: two routers
(dispatcher, pool, updater each) share one weight board file, as the processes of
``--processes 2`` do. Streams run through both while an update goes through the second:
no response mixes versions unless kept (then its chunks say where), none fails, and a
request sent once the update returns, through either, runs on the new weights."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Literal

import pytest
from prometheus_client import CollectorRegistry
from unit.sim_cluster import SimCluster, sim_cluster
from unit.test_weight_pause import versions
from unit.test_weight_updates import MAX_TOKENS, PROMPT, tokens

from pdserve.core.types import Role, SamplingSpec
from pdserve.router.cluster.weight_updates import DiskUpdate, WeightUpdater
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import create_placement
from pdserve.router.dispatch.weight_board import WeightBoard
from pdserve.router.dispatch.workers.pool import WorkerPool


@contextlib.asynccontextmanager
async def two_routers(tmp_path: Path) -> AsyncIterator[
        tuple[SimCluster, list[tuple[PDDispatcher, WeightUpdater]]]]:
    path = tmp_path / "board"
    WeightBoard.create(path, 2)
    boards = [WeightBoard.open(path), WeightBoard.open(path)]
    workers: list[tuple[str, Role]] = [("p0", "prefill"), ("d0", "decode"), ("d1", "decode")]
    async with sim_cluster(workers, DisaggConfig(mode="always"), boards[0],
                           decode_s_per_token=10e-3) as sims:
        assert sims.pool is not None
        pool = WorkerPool([w.snapshot().endpoint for w in sims.pool.prefill],
                          [w.snapshot().endpoint for w in sims.pool.decode], interval_s=0.2)
        second = PDDispatcher(pool, create_placement("round_robin"), CollectorRegistry(), 10.0,
                              weight_board=boards[1])
        await pool.start()
        routers = [(sims.dispatcher, WeightUpdater(sims.pool, sims.dispatcher.weights)),
                   (second, WeightUpdater(pool, second.weights))]
        for _, updater in routers:
            updater.start(interval_s=60.0)
        try:
            yield sims, routers
        finally:
            for _, updater in routers:
                await updater.close()
            await pool.close()
            for board in boards:
                board.close()


async def run(dispatcher: PDDispatcher, request_id: str, prompt: tuple[int, ...] = PROMPT,
              max_tokens: int = MAX_TOKENS) -> list[TokenChunk]:
    return [c async for c in dispatcher.generate(
        request_id, prompt, SamplingSpec(max_tokens=max_tokens, temperature=0.0))]


@pytest.mark.parametrize("policy", ["drain", "abort", "keep"])
async def test_a_refit_through_one_process_holds_for_both(
        tmp_path: Path, policy: Literal["drain", "abort", "keep"]) -> None:
    async with two_routers(tmp_path) as (_, routers):
        (first, _), (second, updater) = routers
        old = tokens(await run(first, "ref-old"))
        streams = [asyncio.create_task(run(d, f"r{i}-{j}"))
                   for i, (d, _) in enumerate(routers) for j in range(3)]
        await asyncio.sleep(0.1)  # every stream is decoding
        await updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2", policy=policy))
        after = [await run(d, f"after-{i}") for i, (d, _) in enumerate(routers)]
        new = tokens(after[0])
        assert new != old
        for chunks in after:  # sent once the update returned, through either process
            assert versions(chunks) == [("v2", MAX_TOKENS)] and tokens(chunks) == new
        for chunks in await asyncio.gather(*streams):  # none failed
            spans = versions(chunks)
            got = tokens(chunks)
            finish = chunks[-1].finish_reason
            if policy == "drain":
                assert spans == [("default", MAX_TOKENS)] and got == old
            elif policy == "abort":
                assert len(spans) == 1, spans  # never mixed
                want = old if spans[0][0] == "default" else new
                assert got == want[:len(got)]
                assert finish == "length" or (finish == "abort" and chunks[-1].ended_by_update)
            else:  # keep: the old weights' tokens, then the new weights' after them
                assert [v for v, _ in spans] == ["default", "v2"], spans
                kept = spans[0][1]
                assert got[:kept] == old[:kept] and finish == "length"
                rest = tokens(await run(first, "ref-rest", (*PROMPT, *got[:kept]),
                                        MAX_TOKENS - kept))
                assert got[kept:] == rest
        for dispatcher, _ in routers:
            assert dispatcher.weights.version == "v2" and not dispatcher.weights.paused
            assert dispatcher.weights.running == []


async def test_pause_through_one_process_holds_the_other(tmp_path: Path) -> None:
    async with two_routers(tmp_path) as (_, routers):
        (first, first_updater), (_, updater) = routers
        await updater.pause("abort", clear_cache=False)
        assert first_updater.paused
        waiting = asyncio.create_task(run(first, "held"))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        first_updater.resume()  # through the other process
        chunks = await asyncio.wait_for(waiting, 10)
        assert len(tokens(chunks)) == MAX_TOKENS
