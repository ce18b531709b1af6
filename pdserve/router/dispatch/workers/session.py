"""The router side of a worker's ``Session``: every request this router runs on one
worker, over one gRPC stream (``worker.proto``: ``Session``).

The worker sends one ``SessionBatch`` per engine step with the outputs of all of this
router's requests; one reader task reads it and hands each output to its request's
``SessionStream`` (a deque and a future: no queue, no task per message). So the router
pays one gRPC read and one event-loop wake per engine step, not per request per token.
Most outputs are plain (one token and nothing else, after a request's first): a
stream starts with ``plain_columns``, and the worker sends those as two columns of the
batch (stream ids, tokens) that the reader takes with two slices, not as a message per
token (``worker.proto``: ``SessionBatch``); an older worker's, in ``outputs``, are read as
well. A stream may have a ``tap``: the reader offers it the token ids of each plain
output that would wake the stream's consumer from an idle wait (the consumer waits in
``next`` and nothing is queued before the output), and an output the tap takes is not
queued at all: the request's chunk sink (``base.ChunkSink``, through
``decode_stream.DecodeStream.tap``) writes it to its client from here.

Ownership and errors:
- A ``SessionStream`` belongs to the caller that started it, who must ``finish`` it
  (``WorkerClient.generate`` does, in a ``finally``): an unfinished stream is cancelled
  on the worker, which aborts the request and frees its KV.
- Each stream has its own deadline (a timer, not a wait per message): past it the
  stream fails with ``DEADLINE_EXCEEDED`` and is cancelled on the worker.
- A session lasts while it has streams, and ``idle_s`` after its last ``finish`` (the
  next request reuses it); then it closes its side, and the worker ends the call.
- If the session's call fails (the worker died, restarted or refused the call), every
  stream on it fails with that call's status, as each ``Generate`` call would have; the
  next ``start`` opens a new session. A worker without ``Session`` (an older version)
  is known from its ``Health`` (no ``session`` there): ``unsupported``, and the client
  uses ``Generate``. A client that never read its health learns it from UNIMPLEMENTED
  instead; grpc may end such a call INTERNAL if a write is in flight, which then fails
  those requests, so the pool's health check comes first.
- With cluster authentication (``auth``), the session's call is signed when it opens and
  nothing is written to it (no prompt) until the worker's answer proved the secret
  (``grpc_auth``); a worker that cannot (or sends nothing within ``PROOF_TIMEOUT_S``)
  fails the session's streams UNAUTHENTICATED.
  Once per session, not per request or token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pdserve.core.grpc_auth import CallAuth, refused_for
from pdserve.proto.convert import plain_token_ids
from pdserve.proto.pdserve.v1 import worker_pb2 as pb

logger = logging.getLogger("pdserve.router.dispatch")
_EOF = grpc.aio.EOF
DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
# A session with no request left stays open this long for the next one (opening one
# costs both sides a call); then it ends, and nothing lingers on either side.
SESSION_IDLE_S = 10.0
SESSION_METHOD = "/pdserve.v1.WorkerService/Session"
# A worker sends its proof as soon as the session opens; one that has not within this
# long fails the session (it has been sent nothing).
PROOF_TIMEOUT_S = 10.0
_CODE_NAMES = {code.value[0]: code.name for code in grpc.StatusCode}


class SessionCallError(Exception):
    """A stream's failure: ``code`` is the gRPC status code's name."""

    def __init__(self, code: str, details: str) -> None:
        super().__init__(f"{code}: {details}")
        self.code = code
        self.details = details


class StreamTapError(RuntimeError):
    """A stream's tap failed: a bug of this router, not the worker's. It ends that
    request with an error (no worker is blamed, nothing migrates)."""


class SessionStream:
    """One request's outputs as they arrive: ``pb.SessionOutput``s and the token ids of
    plain outputs (a tuple), or the ``SessionCallError`` that ends it."""

    __slots__ = ("stream_id", "items", "ended", "tap", "_waiter", "_timer")

    def __init__(self, stream_id: int) -> None:
        self.stream_id = stream_id
        self.items: collections.deque[Any] = collections.deque()
        self.ended = False  # its last output (or failure) was received
        # Offered a plain output's token ids while the consumer is idle in ``next``;
        # True: it took them.
        self.tap: Callable[[tuple[int, ...]], bool] | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def offer(self, output: pb.SessionOutput) -> None:
        """An output of the batch's ``outputs``: a plain one (a call's first, or any from
        an older worker) is offered to the tap as the columns' are; whatever the tap
        does not take is queued as it came."""
        if (self.tap is None or output.end
                or (token_ids := plain_token_ids(output.response)) is None
                or not self._tapped(token_ids)):
            self.push(output)

    def offer_plain(self, token_ids: tuple[int, ...]) -> None:
        """A plain output of the batch's columns: to the tap, else queued."""
        if not self._tapped(token_ids):
            self.push(token_ids)

    def _tapped(self, token_ids: tuple[int, ...]) -> bool:
        """Whether the tap took ``token_ids``: it is offered them only while the consumer
        is idle waiting for them. A tap that raises fails this stream alone with
        ``StreamTapError`` (a bug: logged; the output counts as taken); the session and
        its other streams go on."""
        tap, waiter = self.tap, self._waiter
        if tap is None or self.items or waiter is None or waiter.done():
            return False
        try:
            return tap(token_ids)
        except Exception as exc:
            logger.exception("a stream's tap failed")
            self.tap = None
            self.push(StreamTapError(f"the router's stream tap failed: {exc}"))
            return True

    def push(self, item: Any) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self) -> Any:
        """The next output (a ``pb.SessionOutput``, or a plain one's token ids), or the
        exception that ends the stream (raised)."""
        if not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        item = self.items.popleft()
        if isinstance(item, SessionCallError):
            # The session failed (nothing runs on the worker any more), or the deadline
            # passed here (the request still runs there: ``finish`` cancels it).
            self.ended = item.code != DEADLINE_EXCEEDED
            raise item
        if isinstance(item, StreamTapError):
            raise item  # the request still runs on the worker: ``finish`` cancels it
        if item.__class__ is tuple:
            return item
        if item.end:
            self.ended = True
        return item


class RouterSession:
    """The session to one worker; opened on the first ``start``, again after a failure."""

    def __init__(self, stub: Any, auth: CallAuth | None,
                 idle_s: float = SESSION_IDLE_S) -> None:
        """``idle_s``: how long a session without requests stays open for the next;
        ``auth``: the cluster's authentication (None: an unauthenticated cluster)."""
        self._stub = stub
        self._auth = auth
        self._idle_s = idle_s
        self._streams: dict[int, SessionStream] = {}
        self._outbox: asyncio.Queue[pb.SessionRequest | None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._no_streams = asyncio.Event()  # set while no request runs here
        self._no_streams.set()
        self._readers: set[asyncio.Task[None]] = set()  # this and closing sessions'
        self._next_id = 0
        self.unsupported = False

    def start(self, request: pb.GenerateRequest, timeout_s: float) -> SessionStream:
        """Start ``request`` on the worker; ``finish`` the stream when done with it."""
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._outbox is None:
            self._open()
        assert self._outbox is not None
        self._no_streams.clear()
        self._next_id += 1
        stream = SessionStream(self._next_id)
        self._streams[stream.stream_id] = stream
        stream._timer = asyncio.get_running_loop().call_later(
            max(timeout_s, 0.0), self._expire, stream, timeout_s)
        self._outbox.put_nowait(pb.SessionRequest(
            stream_id=stream.stream_id, start=request, timeout_ns=int(timeout_s * 1e9),
            plain_columns=True))
        return stream

    def finish(self, stream: SessionStream) -> None:
        """The caller is done with ``stream``: cancelled on the worker unless it ended."""
        if stream._timer is not None:
            stream._timer.cancel()
        if self._streams.pop(stream.stream_id, None) is None:
            return  # its session is gone: nothing runs on the worker
        if not self._streams:
            self._no_streams.set()
        outbox = self._outbox
        if outbox is None:
            return
        if not stream.ended:
            outbox.put_nowait(pb.SessionRequest(stream_id=stream.stream_id, cancel=True))
        if not self._streams:  # idle: the session ends unless a start comes in time
            if self._idle_s <= 0:
                self._end_idle(outbox)
            else:
                self._idle = asyncio.get_running_loop().call_later(
                    self._idle_s, self._end_idle, outbox)

    def _end_idle(self, outbox: asyncio.Queue[pb.SessionRequest | None]) -> None:
        self._idle = None
        if self._outbox is outbox and not self._streams:
            outbox.put_nowait(None)  # our side ends; the worker ends the call
            self._outbox = None

    async def close(self, grace_s: float | None = None) -> None:
        """End the session: with ``grace_s``, the requests running on it get that long to
        finish (a worker that left the view drains them), then what is left is cancelled."""
        if grace_s and not self._no_streams.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._no_streams.wait(), grace_s)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._outbox is not None:
            self._outbox.put_nowait(None)
        readers = list(self._readers)
        for reader in readers:
            reader.cancel()
        await asyncio.gather(*readers, return_exceptions=True)

    async def _proof(self, auth: CallAuth, call: Any, nonce: str) -> str | None:
        """None once the worker's answer proved the secret; else why not."""
        try:
            metadata = await asyncio.wait_for(call.initial_metadata(), PROOF_TIMEOUT_S)
        except grpc.aio.AioRpcError:
            return None  # the call failed: ``read`` raises its status next
        except TimeoutError:
            metadata = None  # no answer at all: no proof
        if call.done() and not metadata and await call.code() != grpc.StatusCode.OK:
            return None  # it failed before answering: ``read`` says how; nothing was sent
        reason = auth.verify(SESSION_METHOD, nonce, metadata)
        return None if reason is None else refused_for(auth.peer, reason)

    def _expire(self, stream: SessionStream, timeout_s: float) -> None:
        stream.push(SessionCallError(
            DEADLINE_EXCEEDED, f"the call's deadline ({timeout_s:.3g} s) passed"))

    def _open(self) -> None:
        outbox: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()
        md, nonce = self._auth.sign(SESSION_METHOD) if self._auth is not None else ((), "")
        proven = asyncio.Event()
        if self._auth is None:
            proven.set()
        call = self._stub.Session(_drain(outbox, proven), metadata=md)
        self._outbox = outbox
        self._streams = {}
        reader = asyncio.create_task(self._read(call, outbox, self._streams, nonce, proven))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _read(self, call: Any, outbox: asyncio.Queue[pb.SessionRequest | None],
                    streams: dict[int, SessionStream], nonce: str,
                    proven: asyncio.Event) -> None:
        error = SessionCallError("UNAVAILABLE", "the worker ended the session")
        answered = False  # a batch came: the worker was reached
        try:
            if self._auth is not None and not proven.is_set():
                reason = await self._proof(self._auth, call, nonce)
                if reason is not None:
                    error = SessionCallError("UNAUTHENTICATED", reason)
                    return
                if not call.done():
                    proven.set()  # now the requests may go
            while (batch := await call.read()) is not _EOF:
                answered = True
                if batch.plain_stream_ids:  # first: they come before the same streams' outputs
                    for stream_id, token_id in zip(batch.plain_stream_ids[:],
                                                   batch.plain_token_ids[:], strict=True):
                        stream = streams.get(stream_id)
                        if stream is not None:
                            stream.offer_plain((token_id,))
                for output in batch.outputs:
                    stream = streams.get(output.stream_id)
                    if stream is not None:
                        stream.offer(output)
        except grpc.aio.AioRpcError as exc:
            error = SessionCallError(exc.code().name, exc.details() or "")
            if exc.code() == grpc.StatusCode.INTERNAL and not answered:
                # grpc ends a call INTERNAL ("Internal error from Core") when the transport
                # goes with a write in flight: a worker that went away as the session
                # opened, never one that answered. Unreachable, as a refused connect is.
                error = SessionCallError(
                    "UNAVAILABLE", f"the session failed before the worker answered: "
                    f"{exc.details() or 'INTERNAL'}")
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED and proven.is_set():
                self.unsupported = True  # a worker that proved itself says it has no Session
            elif exc.code() == grpc.StatusCode.UNAUTHENTICATED and self._auth is not None:
                self._auth.learn(exc.trailing_metadata())  # the next session signs for it
        except asyncio.CancelledError:
            error = SessionCallError("CANCELLED", "the router closed the session")
            raise
        finally:
            call.cancel()
            if self._outbox is outbox:  # the next start opens a new session
                self._outbox = None
            outbox.put_nowait(None)
            for stream in list(streams.values()):
                stream.push(error)
            if streams and error.code != "CANCELLED":
                logger.info("session with a worker ended: %s", error)


async def _drain(outbox: asyncio.Queue[pb.SessionRequest | None], proven: asyncio.Event
                 ) -> AsyncIterator[pb.SessionRequest]:
    await proven.wait()  # no request to a worker that has not proved itself
    while (msg := await outbox.get()) is not None:
        yield msg


def code_name(number: int) -> str:
    """A gRPC status code number's name (``"UNAVAILABLE"``)."""
    return _CODE_NAMES.get(number, "UNKNOWN")
