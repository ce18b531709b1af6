"""The ``n`` sequences of one request (OpenAI's ``n``), as one stream of chunks.

The prompt is computed once: sequence 0 is dispatched as any request is (prefilled
remotely or on its decode worker). Once its decode worker has produced a token, the
prompt's KV is in that engine's prefix cache, and sequences 1..n-1 go to the same worker
(the dispatcher's ``affinity``): vLLM's prefix cache shares the prompt's full blocks
between them by reference, and each computes only the prompt's last partial block (fewer
than one block of tokens) before sampling its own first token. That is how vLLM itself
runs ``n`` (its parallel-sampling children share the prefix cache). If sequence 0 ends
before any decode (its first token finished it), the others are placed as usual.

Each sequence is its own dispatcher request (``<request id>-<index>``), seeded
``seed + index`` as vLLM seeds its children, aborted on every worker when its stream is
closed. One failing sequence fails the request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from pdserve.router.dispatch.base import TokenChunk

OpenChoice = Callable[[int, str | None], AsyncGenerator[TokenChunk, None]]


class ChoiceStreams:
    """``(index, chunk)`` pairs of ``n`` sequences in arrival order. ``open_choice(index,
    affinity)`` starts one sequence (``affinity``: the decode worker to follow).
    Owned by the task serving the request; ``aclose()`` stops every sequence."""

    def __init__(self, n: int, open_choice: OpenChoice) -> None:
        self._n = n
        self._open = open_choice
        self._queue: asyncio.Queue[tuple[int, TokenChunk | BaseException | None]] = (
            asyncio.Queue())
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._ended: set[int] = set()
        self._siblings_started = n == 1
        self._started = False  # sequence 0 starts on the first read: nothing runs unread

    def _spawn(self, index: int, affinity: str | None) -> None:
        self._tasks[index] = asyncio.create_task(self._pump(index, affinity))

    async def _pump(self, index: int, affinity: str | None) -> None:
        try:
            stream = self._open(index, affinity)
            async with contextlib.aclosing(stream):
                async for chunk in stream:
                    self._queue.put_nowait((index, chunk))
            self._queue.put_nowait((index, None))
        except Exception as exc:  # reported to the reader, which fails the request
            self._queue.put_nowait((index, exc))

    def _start_siblings(self, affinity: str | None) -> None:
        if not self._siblings_started:
            self._siblings_started = True
            for index in range(1, self._n):
                self._spawn(index, affinity)

    async def next(self) -> tuple[int, TokenChunk] | None:
        """The next chunk of any sequence; None once every sequence has ended."""
        if not self._started:
            self._started = True
            self._spawn(0, None)
        while len(self._ended) < self._n:
            index, item = await self._queue.get()
            if index in self._ended:
                continue  # a sequence closed early may still have chunks queued
            if item is None:
                self._ended.add(index)
                self._start_siblings(None)
                continue
            if isinstance(item, BaseException):
                raise item
            if index == 0 and item.decode_worker_id is not None:
                self._start_siblings(item.decode_worker_id)
            return index, item
        return None

    async def close_choice(self, index: int) -> None:
        """Stop one sequence (its stop string matched): its workers abort it."""
        self._ended.add(index)
        if index == 0:
            self._start_siblings(None)
        task = self._tasks.get(index)
        if task is not None and not task.done():
            task.cancel()  # its stream closes: the dispatcher aborts it on the workers
            await asyncio.wait({task})

    async def aclose(self) -> None:
        """Stop every sequence still running; shielded so that the aborts go out even
        when the caller is being cancelled."""
        tasks = [t for t in self._tasks.values() if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))


async def fan_in(streams: ChoiceStreams) -> AsyncIterator[tuple[int, TokenChunk]]:
    """``streams`` as an async iterator; closing it stops every sequence."""
    try:
        while (item := await streams.next()) is not None:
            yield item
    finally:
        await streams.aclose()


async def single_choice(chunks: AsyncGenerator[TokenChunk, None]
                        ) -> AsyncIterator[tuple[int, TokenChunk]]:
    """One sequence as ``(0, chunk)`` pairs; closing it closes ``chunks``."""
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            yield 0, chunk
