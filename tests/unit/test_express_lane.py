"""The express lane (``dispatch.base.ChunkSink``): ordinary decode chunks handed to the
HTTP layer's sink by the worker session's reader, the rest yielded as before.

On ``SessionStream`` alone: a tap sees an output only while the consumer waits with
nothing queued, and a tap that raises fails its own stream. Through the
``PDDispatcher`` over gRPC (the scripted workers of ``fake_worker.py``): what the sink
takes and what the iterator yields, in the order each arrived, is the whole answer,
with a sink that takes everything, one that declines everything, one that declines
now and then (a slow client), and a decode worker that dies mid-stream (migration).
The HTTP side (the sink, the bytes) is in ``test_sse_golden.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from unit.dispatch_cluster import PROMPT, running_cluster, spec
from unit.fake_worker import greedy_answer

from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.router.dispatch.base import TokenChunk
from pdserve.router.dispatch.migration import MigrationConfig
from pdserve.router.dispatch.workers.session import SessionStream, StreamTapError

WAIT_S = 5.0


def _output(token: int, end: bool = False) -> pb.SessionOutput:
    return pb.SessionOutput(stream_id=1, end=end,
                            response=pb.GenerateResponse(token_ids=[token]))


# ---- SessionStream alone ------------------------------------------------------------


async def test_a_tap_is_offered_an_output_only_while_the_consumer_waits_for_it() -> None:
    stream, tapped = SessionStream(1), []

    def tap(ids: tuple[int, ...]) -> bool:
        tapped.append(ids[0])
        return True

    stream.tap = tap

    stream.offer(_output(1))  # nobody waits yet: queued
    assert tapped == [] and len(stream.items) == 1
    assert (await stream.next()).response.token_ids == [1]

    waiting = asyncio.ensure_future(stream.next())
    await asyncio.sleep(0)  # the consumer waits now
    stream.offer(_output(2))  # taken: the consumer stays waiting
    assert tapped == [2] and not waiting.done()
    stream.tap = lambda ids: False  # a tap that declines: queued, the consumer wakes
    stream.offer(_output(3))
    stream.offer(_output(4))  # queued behind 3 (never offered past a queued output)
    assert (await waiting).response.token_ids == [3]
    assert [o.response.token_ids[0] for o in stream.items] == [4]


async def test_a_tap_that_raises_fails_its_own_stream() -> None:
    stream = SessionStream(1)

    def broken(token_ids: tuple[int, ...]) -> bool:
        raise ValueError("bug")

    stream.tap = broken
    waiting = asyncio.ensure_future(stream.next())
    await asyncio.sleep(0)
    stream.offer(_output(1))
    with pytest.raises(StreamTapError, match="bug"):
        await waiting
    assert stream.tap is None and not stream.ended  # ``finish`` cancels it on the worker


# ---- through the dispatcher -----------------------------------------------------------


class Lane:
    """A ``ChunkSink`` that records what it takes, in one log with what the iterator
    yields: ``("sink" | "yield", token ids)`` in arrival order, and the chunks it took."""

    def __init__(self, take: bool | list[bool] = True) -> None:
        self.accepting = False
        self.log: list[tuple[str, tuple[int, ...]]] = []
        self.took: list[TokenChunk] = []
        self._take = take

    def offer(self, chunk: TokenChunk) -> bool:
        if not self.accepting:
            return False
        take = self._take if isinstance(self._take, bool) else self._take[len(self.log) % 3]
        if take:
            self.log.append(("sink", chunk.token_ids))
            self.took.append(chunk)
        return take

    async def read(self, chunks: AsyncIterator[TokenChunk]) -> list[TokenChunk]:
        """As the HTTP body does: the sink is open while it waits for the next chunk."""
        got = []
        self.accepting = True
        try:
            async with asyncio.timeout(WAIT_S):
                async for chunk in chunks:
                    self.log.append(("yield", chunk.token_ids))
                    got.append(chunk)
        finally:
            self.accepting = False
        return got

    def tokens(self) -> list[int]:
        return [t for _, ids in self.log for t in ids]

    def taken(self) -> int:
        return sum(len(ids) for how, ids in self.log if how == "sink")


@pytest.mark.parametrize("take", [True, False, [True, False, True]],
                         ids=["takes-all", "declines-all", "declines-some"])
async def test_the_sink_and_the_iterator_together_carry_the_whole_answer(
        take: bool | list[bool]) -> None:
    max_tokens = 12
    async with running_cluster() as c:
        c.p.script.tokens_from_context = c.d.script.tokens_from_context = True
        c.d.script.token_delay_s = 0.01
        lane = Lane(take)
        chunks = await lane.read(c.dispatcher.generate(
            "r1", PROMPT, spec(max_tokens), sink=lane))

        assert lane.tokens() == greedy_answer(PROMPT, max_tokens)
        # The sink gets the very chunk the iterator would have yielded: its worker named.
        assert all(c.decode_worker_id == chunks[-1].decode_worker_id for c in lane.took)
        # Never taken: prefill's first chunk (it opens the request) and the last.
        assert chunks[0].num_cached_tokens is not None and chunks[0].disagg is not None
        assert chunks[-1].finish_reason == "length"
        assert lane.log[0][0] == lane.log[-1][0] == "yield"
        if take is True:
            assert [how for how, _ in lane.log] == ["yield", *["sink"] * (max_tokens - 2),
                                                     "yield"]
        if take is False:
            assert lane.taken() == 0 and len(chunks) == max_tokens


async def test_a_sink_that_raises_fails_its_request_alone_and_blames_no_worker() -> None:
    """A bug in the lane (the sink raises) ends that request with the error, as the same
    bug in the body's loop would: no worker is blamed, nothing migrates, the request is
    cancelled on its worker, and the other request on the same session goes on."""
    max_tokens = 12
    async with running_cluster(num_decode=1, migration=MigrationConfig(max_migrations=1)) as c:
        c.p.script.tokens_from_context = c.d.script.tokens_from_context = True
        c.d.script.token_delay_s = 0.01
        fine = Lane()

        class Broken:
            accepting = True

            def offer(self, chunk: TokenChunk) -> bool:
                raise ValueError("bug in the sink")

        failing = c.dispatcher.generate("bad", PROMPT, spec(max_tokens), sink=Broken())
        other = asyncio.ensure_future(fine.read(c.dispatcher.generate(
            "good", (*PROMPT, 1), spec(max_tokens), sink=fine)))
        with pytest.raises(StreamTapError, match="bug in the sink"):
            async with asyncio.timeout(WAIT_S):
                async for _ in failing:
                    pass
        await other
        assert fine.tokens() == greedy_answer((*PROMPT, 1), max_tokens)
        assert all(w.snapshot().healthy for w in c.pool.decode)  # not blamed
        assert c.registry.get_sample_value("pdserve:migrations_total") in (None, 0.0)
        assert [g.request_id for g in c.d.generates].count("bad") == 1  # not migrated


async def test_a_decode_worker_dying_mid_stream_migrates_with_the_lane_open() -> None:
    """Both decode workers hold a stream whose tokens the lane takes; one dies: its
    stream goes on on the other, and each client's tokens are the uninterrupted answer."""
    max_tokens = 16
    prompts = {f"r{i}": (*PROMPT, i) for i in range(2)}
    async with running_cluster(num_decode=2, migration=MigrationConfig(max_migrations=1)) as c:
        for w in (c.prefill, *c.decodes):
            w.servicer.script.tokens_from_context = True
            w.servicer.script.token_delay_s = 0.05
        lanes = {rid: Lane() for rid in prompts}
        reads = {rid: asyncio.ensure_future(lanes[rid].read(c.dispatcher.generate(
            rid, p, spec(max_tokens), sink=lanes[rid])))
            for rid, p in prompts.items()}
        async with asyncio.timeout(WAIT_S):
            while not all(lane.taken() >= 3 for lane in lanes.values()):
                await asyncio.sleep(0.01)
        victim = next(d for d in c.decodes if d.servicer.inflight)
        moved = set(victim.servicer.inflight)

        await victim.stop()
        await asyncio.gather(*reads.values())

        for rid, lane in lanes.items():
            assert lane.tokens() == greedy_answer(prompts[rid], max_tokens), rid
        other = next(d for d in c.decodes if d is not victim)
        assert {g.request_id for g in other.servicer.generates} >= moved
        assert all(lane.taken() > 3 for lane in lanes.values())
