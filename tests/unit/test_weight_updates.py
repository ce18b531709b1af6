"""Cluster weight updates, router and simulated workers over real gRPC
(``router/cluster/weight_updates.py``, ``router/dispatch/weights.py``): two phases, one
version per request, the policies, and the workers out of step."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from pdserve_testing import wait_until_async
from unit.sim_cluster import SimCluster, sim_cluster

from pdserve.core.block_hash import chain_hashes, salt_root, versioned_salt
from pdserve.core.types import Role, SamplingSpec
from pdserve.router.cluster.errors import ClusterError
from pdserve.router.cluster.weight_updates import DiskUpdate, WeightUpdater
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.dispatch.workers.pool import Worker
from pdserve.router.http.errors import to_api_error

PROMPT = tuple(range(1, 40))
MAX_TOKENS = 40  # 40 steps of 10 ms: long enough for an update to land mid-stream


@dataclass
class Bench:
    sims: SimCluster
    updater: WeightUpdater
    checkpoint: Path

    async def run(self, request_id: str, prompt: tuple[int, ...] = PROMPT) -> list[TokenChunk]:
        chunks = self.sims.dispatcher.generate(
            request_id, prompt, SamplingSpec(max_tokens=MAX_TOKENS, temperature=0.0))
        return [c async for c in chunks]

    def versions(self) -> set[str]:
        return set(self.updater.info()["workers"].values())


@contextlib.asynccontextmanager
async def bench(tmp_path: Path, num_prefill: int = 1, **sim: Any) -> AsyncIterator[Bench]:
    workers: list[tuple[str, Role]] = [*((f"p{i}", "prefill") for i in range(num_prefill)),
                                       ("d0", "decode")]
    async with sim_cluster(workers, DisaggConfig(mode="always"), decode_s_per_token=10e-3,
                           **sim) as sims:
        assert sims.pool is not None
        yield Bench(sims, WeightUpdater(sims.pool, sims.dispatcher.weights), tmp_path)


def tokens(chunks: list[TokenChunk]) -> list[int]:
    return [t for c in chunks for t in c.token_ids]


async def test_an_update_switches_every_worker_and_requests_follow(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        before = await b.run("r0")
        assert before[0].weight_version == "default"
        result = await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2"))
        assert result["success"] and result["workers"] == {"p0": "v2", "d0": "v2"}
        assert b.versions() == {"v2"} and b.updater.info()["weight_version"] == "v2"
        after = await b.run("r1")
        assert after[0].weight_version == "v2"
        assert tokens(after) != tokens(before) and len(tokens(after)) == MAX_TOKENS


async def test_a_worker_that_cannot_stage_keeps_the_whole_cluster_on_its_version(
        tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        with pytest.raises(ClusterError) as refused:
            await b.updater.update_from_disk(DiskUpdate(
                model_path=str(tmp_path / "missing"), weight_version="v2"))
        assert to_api_error(refused.value).status_code == 400
        assert refused.value.code == "invalid_checkpoint"
        assert b.versions() == {"default"}
        assert b.sims.pool is not None
        for worker in b.sims.pool.all:  # every stage was dropped: nothing to commit
            with pytest.raises(WorkerCallError, match="nothing is staged"):
                await worker.client.commit_weights("v2", False, 0.0, 5.0)
        chunks = await b.run("r0")  # still serving
        assert chunks[0].weight_version == "default" and len(tokens(chunks)) == MAX_TOKENS


async def test_drain_lets_a_running_stream_finish_on_the_old_weights(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        reference = tokens(await b.run("ref"))
        running = asyncio.create_task(b.run("r0"))
        await asyncio.sleep(0.1)  # decoding now
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2", policy="drain"))
        assert running.done()  # the switch waited for it
        chunks = running.result()
        assert chunks[0].weight_version == "default" and tokens(chunks) == reference


async def test_abort_cuts_a_visible_stream_and_reruns_an_invisible_one(tmp_path: Path) -> None:
    # Not in any prefix cache: r1's prefill takes 2 s, longer than the update takes to
    # stage on a loaded machine (with 39 tokens, 0.4 s, it once sent r1's first token
    # before the abort, under four test processes on two cores).
    other = (99, *range(1000, 1200))
    async with bench(tmp_path, prefill_s_per_token=10e-3) as b:
        old = tokens(await b.run("ref-old"))
        visible = asyncio.create_task(b.run("r0"))  # cached prompt: decodes at once ...
        await asyncio.sleep(0.1)
        invisible = asyncio.create_task(b.run("r1", other))
        await asyncio.sleep(0.05)  # ... while r1 is still in its prefill (nothing sent)
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2", policy="abort"))
        cut = await visible
        assert cut[-1].finish_reason == "abort" and cut[-1].ended_by_update
        assert cut[0].weight_version == "default"
        assert tokens(cut) == old[:len(tokens(cut))] and len(tokens(cut)) < MAX_TOKENS
        rerun = await invisible
        new = tokens(await b.run("ref-new", other))
        assert rerun[0].weight_version == "v2" and tokens(rerun) == new
        assert b.sims.registry.get_sample_value("pdserve:weight_update_reruns_total") == 1


async def _back_on_first_weights(b: Bench, tmp_path: Path) -> Worker:
    """The decode worker, back on its first weights, as after a restart, once the
    router's view of it says so. One probe is not enough under load: a probe that times
    out keeps the worker's earlier report ("v2", healthy), and one overtaken by the
    pool's own adopts nothing; so probe until the report changes, within 20 s."""
    assert b.sims.pool is not None
    worker = b.sims.pool.decode[0]
    await worker.client.stage_weights(str(tmp_path), "default", 5.0)
    await worker.client.commit_weights("default", False, 0.0, 5.0)
    deadline = asyncio.get_running_loop().time() + 20.0
    while worker.snapshot().weight_version != "default":
        assert asyncio.get_running_loop().time() < deadline, worker.snapshot()
        await worker.refresh(2.0)
    return worker


async def test_a_worker_on_another_version_is_out_of_placement(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2"))
        assert b.sims.pool is not None
        worker = await _back_on_first_weights(b, tmp_path)
        assert not worker.snapshot().healthy and worker.snapshot().weight_version == "default"
        assert b.updater.info()["workers"]["d0"] == "default"


async def test_pause_holds_new_requests_until_resume(tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        await b.updater.pause("keep")
        assert b.updater.paused
        waiting = asyncio.create_task(b.run("r0"))
        await asyncio.sleep(0.1)
        assert not waiting.done()
        b.updater.resume()
        assert await wait_until_async(waiting.done, 5)
        assert len(tokens(waiting.result())) == MAX_TOKENS


async def test_a_worker_back_on_other_weights_is_brought_to_the_clusters(
        tmp_path: Path) -> None:
    async with bench(tmp_path) as b:
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2"))
        assert b.sims.pool is not None
        worker = await _back_on_first_weights(b, tmp_path)
        assert worker.stale_weights and not worker.snapshot().healthy
        assert await b.updater.catch_up() == ["d0"]
        assert worker.snapshot().healthy and b.versions() == {"v2"}
        assert (await b.run("r0"))[0].weight_version == "v2"
        assert await b.updater.catch_up() == []  # nothing left to do


async def test_after_an_update_the_router_finds_the_prefixes_cached_under_the_new_weights(
        tmp_path: Path) -> None:
    async with bench(tmp_path, num_prefill=2) as b:
        await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2"))
        prompt = tuple(range(1, 200))
        await b.run("r0", prompt)  # computed under v2 on the prefill worker
        names = chain_hashes(prompt, 16, salt_root(versioned_salt(None, "v2")))
        unversioned = chain_hashes(prompt, 16)
        assert await wait_until_async(lambda: b.sims.index.match(names), 5)
        assert not b.sims.index.match(unversioned)  # the old weights' names: none
        # Placement hashes the next ones the same way: each goes to the prefill worker
        # holding the prompt (cache-aware), which computes none of its full blocks.
        for i in range(3):
            again = await b.run(f"r{i + 1}", prompt)
            assert again[0].num_cached_tokens == len(names) * 16


async def test_a_killed_worker_fails_the_stage_and_the_others_keep_their_version(
        tmp_path: Path) -> None:
    async with bench(tmp_path, num_prefill=2) as b:
        assert b.sims.pool is not None
        await b.sims.servers[1].stop(0)  # p1 is gone, still in the view
        with pytest.raises(ClusterError) as refused:
            await b.updater.update_from_disk(DiskUpdate(
                model_path=str(tmp_path), weight_version="v2"))
        assert to_api_error(refused.value).status_code == 503 and "p1" in refused.value.message
        living = [w for w in b.sims.pool.all if w.snapshot().worker_id != "p1"]
        assert len(living) == 2
        for worker in living:
            with pytest.raises(WorkerCallError, match="nothing is staged"):
                await worker.client.commit_weights("v2", False, 0.0, 5.0)
            await worker.refresh(2.0)
            assert worker.snapshot().weight_version == "default"
        chunks = await b.run("r0")  # the living serve, on their version
        assert chunks[0].weight_version == "default" and len(tokens(chunks)) == MAX_TOKENS


async def test_a_probe_sent_before_the_switch_never_files_a_worker_under_the_old_weights(
        tmp_path: Path) -> None:
    """A health probe answered before the commit but landing after it (a busy router
    loop, a slow link) must not take the worker out of placement as stale."""
    async with bench(tmp_path) as b:
        assert b.sims.pool is not None
        decode = b.sims.pool.decode[0]
        health = decode.client.health
        answered, release = asyncio.Event(), asyncio.Event()

        async def late_health(timeout_s: float):  # type: ignore[no-untyped-def]
            old = await health(timeout_s)  # the version before the update
            answered.set()
            await release.wait()
            return old

        decode.client.health = late_health  # type: ignore[method-assign]
        probe = asyncio.create_task(decode.refresh(5.0))
        await answered.wait()
        decode.client.health = health  # type: ignore[method-assign]
        result = await b.updater.update_from_disk(DiskUpdate(
            model_path=str(tmp_path), weight_version="v2"))
        assert result["workers"]["d0"] == "v2"
        release.set()
        await probe
        state = decode.snapshot()
        assert state.healthy and state.weight_version == "v2"
        chunks = await b.run("after")
        assert chunks[0].weight_version == "v2" and len(tokens(chunks)) == MAX_TOKENS
