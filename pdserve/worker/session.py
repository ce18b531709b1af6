"""The worker side of a ``Session``: one router's requests over one gRPC stream.

Each started request runs as a ``Generate`` call would (``run`` is the servicer's own
code: admission, backend, error mapping), in a task of its own; its outputs go to one
outbox. The writer sends the outbox as one ``SessionBatch`` whenever it has something:
after the first output of a wake-up it yields once to the event loop, so every request
that the same engine step woke has added its output by then (vLLM's output handler
wakes all of a step's requests in one pass). A request's own outputs stay in order.

Plain outputs (one token and nothing else, after a request's first) of a request the
router started with ``plain_columns`` go in the batch's two plain columns, a stream id
and a token each, not in a message of their own: the router reads a step's tokens with
two slices instead of a message per token. A request's outputs go in ``outputs`` from
its first one there on, within a batch, so its column entries always come first.

Ownership: the session owns its request tasks. A ``cancel`` from the router, or the
stream ending for any reason, cancels them; cancelling closes the backend's output
iterator, which aborts the request in the engine and frees its KV, exactly as a
cancelled ``Generate`` call does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc

from pdserve.proto.convert import plain_token_ids
from pdserve.proto.pdserve.v1 import worker_pb2 as pb

logger = logging.getLogger("pdserve.worker")

# One request's outputs, as the servicer makes them for Generate; raises a
# (code, details) ``RequestFailed`` where Generate would end with that status.
RunRequest = Callable[[pb.GenerateRequest, float | None],
                      AsyncGenerator[pb.GenerateResponse, None]]


class RequestFailed(Exception):
    """A request ended with a gRPC status other than OK (its outputs stop there)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class WorkerSession:
    """One ``Session`` stream: reads the router's requests, runs them, batches outputs."""

    def __init__(self, run: RunRequest) -> None:
        self._run = run
        self._tasks: dict[int, asyncio.Task[None]] = {}
        self._outbox: list[pb.SessionOutput] = []
        self._in_outbox: set[int] = set()  # the streams with an output in ``_outbox``
        self._plain_ids: list[int] = []  # the plain columns: stream ids and tokens
        self._plain_tokens: list[int] = []
        self._wake = asyncio.Event()
        self._reading = True
        # A protocol error of the router (a stream id started twice): the session ends
        # with it, every stream on it failing, rather than answer one id for two streams.
        self._violation: RequestFailed | None = None

    async def serve(self, requests: AsyncIterator[pb.SessionRequest]
                    ) -> AsyncIterator[pb.SessionBatch]:
        """The batches to send, until the router closes its side and every request
        has ended; the stream's end (or cancellation) cancels what still runs."""
        reader = asyncio.create_task(self._read(requests))
        try:
            while self._reading or self._tasks or self._outbox or self._plain_ids:
                if not self._outbox and not self._plain_ids:
                    self._wake.clear()
                    await self._wake.wait()
                    await asyncio.sleep(0)  # the rest of this engine step's outputs
                if self._violation is not None:
                    raise self._violation
                batch, self._outbox = self._outbox, []
                ids, tokens, self._plain_ids, self._plain_tokens = (
                    self._plain_ids, self._plain_tokens, [], [])
                self._in_outbox.clear()
                if batch or ids:
                    yield pb.SessionBatch(outputs=batch, plain_stream_ids=ids,
                                          plain_token_ids=tokens)
        finally:
            reader.cancel()
            tasks = list(self._tasks.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(reader, *tasks, return_exceptions=True)

    async def _read(self, requests: AsyncIterator[pb.SessionRequest]) -> None:
        try:
            async for msg in requests:
                if msg.HasField("start"):
                    self._start(msg.stream_id, msg.start,
                                msg.timeout_ns / 1e9 if msg.timeout_ns else None,
                                msg.plain_columns)
                elif (task := self._tasks.get(msg.stream_id)) is not None:
                    task.cancel()
        except grpc.aio.AioRpcError as exc:  # the router is gone: the stream ends
            logger.info("session ended by its router: %s", exc.code().name)
        finally:
            self._reading = False
            self._wake.set()

    def _start(self, stream_id: int, request: pb.GenerateRequest, timeout_s: float | None,
               columns: bool) -> None:
        if stream_id in self._tasks:
            logger.error("session protocol error: stream %d started twice", stream_id)
            self._violation = RequestFailed(
                grpc.StatusCode.INTERNAL, f"session protocol error: stream {stream_id} was "
                "started while it runs; the session ends")
            self._wake.set()
            return
        task = asyncio.create_task(self._one(stream_id, request, timeout_s, columns))
        self._tasks[stream_id] = task
        # Not in ``_one``: a task cancelled before it first ran never runs its code.
        task.add_done_callback(functools.partial(self._ended, stream_id))

    async def _one(self, stream_id: int, request: pb.GenerateRequest, timeout_s: float | None,
                   columns: bool) -> None:
        """``columns``: the router reads the request's plain outputs from the columns."""
        end = pb.SessionOutput(stream_id=stream_id, end=True)
        try:
            async with contextlib.aclosing(self._run(request, timeout_s)) as responses:
                plain = False  # a call's first output carries its counts: never plain
                async for response in responses:
                    if not (plain and self._put_plain(stream_id, response)):
                        self._put(pb.SessionOutput(stream_id=stream_id, response=response))
                    plain = columns
        except asyncio.CancelledError:
            return  # cancelled by the router (or the session's end): it reads no more
        except RequestFailed as exc:
            end.status_code, end.status_details = exc.code.value[0], exc.details
        except Exception as exc:  # noqa: BLE001 - a bug in the run: the router is told
            logger.exception("session request %d failed", stream_id)
            end.status_code = grpc.StatusCode.INTERNAL.value[0]
            end.status_details = f"{type(exc).__name__}: {exc}"
        self._put(end)

    def _ended(self, stream_id: int, task: asyncio.Task[None]) -> None:
        """A request's task is done, however (a cancelled one sends nothing): the
        writer looks again whether the session is over."""
        if self._tasks.get(stream_id) is task:
            del self._tasks[stream_id]
        self._wake.set()

    def _put(self, output: pb.SessionOutput) -> None:
        self._outbox.append(output)
        self._in_outbox.add(output.stream_id)
        self._wake.set()

    def _put_plain(self, stream_id: int, response: pb.GenerateResponse) -> bool:
        """Whether ``response`` went in the plain columns: one token and nothing else, of
        a stream with nothing in this batch's ``outputs`` yet."""
        if stream_id in self._in_outbox:
            return False
        token_ids = plain_token_ids(response)
        if token_ids is None or len(token_ids) != 1:
            return False
        self._plain_ids.append(stream_id)
        self._plain_tokens.append(token_ids[0])
        self._wake.set()
        return True
