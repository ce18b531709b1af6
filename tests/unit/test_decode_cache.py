"""The decode-side prefix cache, wired, against simulated workers over real gRPC: the
router follows every worker's KV events (decode's too), so a conversation's next turn
goes to the decode worker that holds its earlier turns, which computes only the new
tokens (``decode_cached``), with no prefill call; under another ``cache_salt`` the same
turns share nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest_asyncio
from pdserve_testing import wait_until_async
from unit.sim_cluster import SimCluster, sim_cluster

from pdserve.core.types import Role, SamplingSpec
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.dispatch.policies.disagg import DisaggConfig

BS = 16
# Prompts over 4 blocks are long (remote), unless decode holds all but that many.
AUTO = DisaggConfig(mode="auto", local_prefill_max_tokens=4 * BS)


class Cluster(SimCluster):
    async def run(self, request_id: str, prompt: list[int], cache_salt: str | None = None
                  ) -> list[TokenChunk]:
        return [c async for c in self.dispatcher.generate(
            request_id, prompt, SamplingSpec(max_tokens=4, cache_salt=cache_salt))]

    def metric(self, name: str) -> float:
        return self.registry.get_sample_value(name) or 0.0


@pytest_asyncio.fixture(loop_scope="function")
async def cluster() -> AsyncIterator[Cluster]:
    workers: tuple[tuple[str, Role], ...] = (("p0", "prefill"), ("d0", "decode"), ("d1", "decode"))
    async with sim_cluster(workers, AUTO, block_size=BS, num_blocks=256,
                           prefill_s_per_token=1e-5, step_overhead_s=1e-3,
                           decode_s_per_token=1e-3) as sims:
        yield Cluster(sims.dispatcher, sims.engines, sims.index, sims.registry)


def turn(history: list[int], new: int, seed: int) -> list[int]:
    """The conversation so far, then ``new`` tokens of the next user turn."""
    return [*history, *(seed * 1000 + i for i in range(new))]


async def test_next_turn_goes_to_the_decode_worker_holding_the_conversation(
        cluster: Cluster) -> None:
    c = cluster
    first = turn([], 20 * BS, 1)
    chunks = await c.run("t1", first)
    assert chunks[0].disagg is not None and chunks[0].disagg.reason == "long_prompt"
    holder = chunks[-1].decode_worker_id
    assert holder in ("d0", "d1")
    # The holder's engine announced the prompt's blocks it loaded; the index has them.
    assert await wait_until_async(lambda: len(c.index.blocks_of(holder)) >= 20, 5)
    computed = c.engines["p0"].counters.prompt_tokens_computed
    answer = [t for ch in chunks for t in ch.token_ids]
    second = turn([*first, *answer[:-1]], 2 * BS, 2)  # its reply, then 32 new tokens
    chunks = await c.run("t2", second)
    assert chunks[0].disagg is not None and chunks[0].disagg.reason == "decode_cached"
    assert chunks[-1].decode_worker_id == holder
    assert c.engines["p0"].counters.prompt_tokens_computed == computed  # no prefill call
    assert c.metric("pdserve:placement_decode_matched_tokens_total") == 20 * BS
    assert c.metric("pdserve:placement_decode_prompt_tokens_total") == len(first) + len(second)
    assert c.registry.get_sample_value("pdserve:disagg_decisions_total", {
        "decision": "local", "reason": "decode_cached"}) == 1
    # Another conversation, as long, held by no decode worker: remote again.
    chunks = await c.run("u1", turn([], 20 * BS, 3))
    assert chunks[0].disagg is not None and chunks[0].disagg.reason == "long_prompt"


async def test_a_conversation_under_another_salt_shares_nothing(cluster: Cluster) -> None:
    """The same turns under salt B find nothing salt A computed: not on the prefill
    worker, not on the decode worker that holds A's conversation (so no decode_cached)."""
    c = cluster
    first = turn([], 20 * BS, 4)
    chunks = await c.run("a1", first, "tenant-a")
    holder = chunks[-1].decode_worker_id
    assert holder is not None
    assert await wait_until_async(lambda: len(c.index.blocks_of(holder)) >= 20, 5)
    second = turn([*first, *(t for ch in chunks for t in ch.token_ids)][:-1], 2 * BS, 5)
    again = await c.run("a2", second, "tenant-a")
    assert again[0].disagg is not None and again[0].disagg.reason == "decode_cached"
    for salt in ("tenant-b", None):
        other = await c.run(f"b-{salt}", second, salt)
        assert other[0].disagg is not None and other[0].disagg.reason == "long_prompt"
        assert other[0].num_cached_tokens == 0  # the prefill worker's cache: nothing
