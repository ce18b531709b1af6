"""The router's dispatcher with ``cache_aware`` placement against simulated workers
over real gRPC (their prefix caches emit KV events through the same relay as
vLLM workers): repeated prefixes stick to their holder, the hit metrics and
``cached_tokens`` follow, a flood spills, and a new prefix already in flight
draws a concurrent request with the same prefix to its worker (pending blocks)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest_asyncio
from pdserve_testing import wait_until_async
from unit.sim_cluster import SimCluster, sim_cluster

from pdserve.core.block_hash import chain_hashes
from pdserve.core.types import Role, SamplingSpec
from pdserve.router.dispatch.policies.disagg import DisaggConfig

BS = 16
# Placement of prefills is under test: every request goes to a prefill worker.
ALWAYS = DisaggConfig(mode="always")
PLACED = "pdserve:placement_decisions_total"


class SimRouter(SimCluster):
    async def run(self, request_id: str, prompt: list[int]) -> int:
        """Runs a request; returns the cached tokens its first chunk reported."""
        chunks = [c async for c in self.dispatcher.generate(
            request_id, prompt, SamplingSpec(max_tokens=3))]
        assert sum(len(c.token_ids) for c in chunks) == 3
        return chunks[0].num_cached_tokens or 0

    def placed(self) -> dict[str, int]:
        """Prefills placed per prefill worker (the router's metric)."""
        return {w: int(self.registry.get_sample_value(
            PLACED, {"policy": "cache_aware", "role": "prefill", "worker_id": w}) or 0)
            for w in self.computed()}

    def prefilling(self) -> bool:
        return any(e.counters.num_running_reqs for e in self.engines.values()
                   if e.config.role == "prefill")

    def computed(self) -> dict[str, int]:
        return {w: e.counters.prompt_tokens_computed for w, e in self.engines.items()
                if e.config.role == "prefill"}


@pytest_asyncio.fixture(loop_scope="function")
async def sim_router() -> AsyncIterator[SimRouter]:
    workers: tuple[tuple[str, Role], ...] = (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))
    async with sim_cluster(workers, ALWAYS, block_size=BS, num_blocks=64,
                           prefill_s_per_token=2e-4, step_overhead_s=1e-3,
                           decode_s_per_token=1e-4) as sims:
        yield SimRouter(sims.dispatcher, sims.engines, sims.index, sims.registry)


def prompt(prefix: int, suffix: int, blocks: int = 20) -> list[int]:
    return [1000 * prefix + i for i in range(blocks * BS)] + [7, suffix, suffix + 1]


async def test_repeated_prefix_sticks_to_its_holder(sim_router: SimRouter) -> None:
    r = sim_router
    assert await r.run("a0", prompt(1, 0)) == 0
    (holder,) = [w for w, n in r.computed().items() if n > 0]
    assert await wait_until_async(lambda: len(r.index.blocks_of(holder)) == 20, 5)
    for i in range(1, 5):
        before = r.computed()
        assert await r.run(f"a{i}", prompt(1, i)) == 20 * BS
        after = r.computed()
        assert after[holder] - before[holder] == 3 and all(
            after[w] == before[w] for w in after if w != holder)
    # The engines' reported hits and the index's predictions agree, request by request.
    ratio = r.registry.get_sample_value("pdserve:prefix_cache_hit_ratio")
    predicted = r.registry.get_sample_value("pdserve:prefix_index_hit_ratio")
    assert ratio == predicted == (4 * 20 * BS) / (5 * len(prompt(1, 0)))


async def test_flood_spills_from_the_holder(sim_router: SimRouter) -> None:
    r = sim_router
    await r.run("w", prompt(2, 0))
    (holder,) = [w for w, n in r.computed().items() if n > 0]
    (other,) = [w for w in r.computed() if w != holder]
    assert await wait_until_async(lambda: len(r.index.blocks_of(holder)) == 20, 5)
    before = r.computed()
    await asyncio.gather(*(r.run(f"f{i}", prompt(2, i)) for i in range(1, 25)))
    after = r.computed()
    placed = {w: r.registry.get_sample_value(PLACED, {
        "policy": "cache_aware", "role": "prefill", "worker_id": w}) or 0 for w in (holder, other)}
    assert placed[holder] + placed[other] == 25
    assert placed[other] >= 1 and placed[holder] > placed[other], placed
    assert after[other] - before[other] >= 20 * BS  # the other computed the prefix itself


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {w: after[w] - before[w] for w in after}


async def test_concurrent_same_new_prefix_same_prefill_worker(sim_router: SimRouter) -> None:
    r = sim_router
    placed, computed = r.placed(), r.computed()
    # 40 new blocks: ~130 ms of modelled prefill, so the second request arrives
    # while the first is computing and before any KV event names the prefix.
    first = asyncio.create_task(r.run("n0", prompt(3, 0, blocks=40)))
    assert await wait_until_async(lambda: r.prefilling() or first.done(), 5)
    assert r.index.match(chain_hashes(prompt(3, 0, blocks=40), BS)) != {}  # pending only
    assert await r.run("n1", prompt(3, 1, blocks=40)) == 40 * BS  # served from cache
    assert await first == 0
    (holder,) = [w for w, n in _delta(r.placed(), placed).items() if n]
    assert _delta(r.placed(), placed)[holder] == 2
    assert _delta(r.computed(), computed) == {
        w: (len(prompt(3, 0, blocks=40)) + 3 if w == holder else 0) for w in computed}
    # The worker's KV events confirm the pending blocks.
    assert await wait_until_async(lambda: len(r.index.blocks_of(holder)) == 40, 5)
    assert len(r.index.pending) == 0


async def test_concurrent_different_new_prefixes_may_spread(sim_router: SimRouter) -> None:
    r = sim_router
    placed = r.placed()
    first = asyncio.create_task(r.run("m0", prompt(4, 0, blocks=40)))
    assert await wait_until_async(r.prefilling, 5)
    # Nothing shared: no pending credit, no cache hit, wherever it goes.
    assert await r.run("m1", prompt(5, 0, blocks=40)) == 0
    assert await first == 0
    assert sum(_delta(r.placed(), placed).values()) == 2
