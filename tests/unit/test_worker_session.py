"""The worker ``Session`` (``worker/session.py``, ``router/dispatch/workers/session.py``):
one stream per (router, worker) carrying every request of the router, one
``SessionBatch`` per engine step.

Batching is checked on ``WorkerSession`` alone, with a scripted ``run`` whose requests
wake on shared engine ``Steps`` (exact batch counts); the rest through gRPC: a
``WorkerClient`` against the scripted worker (``fake_worker.py``) whose sessions a spy
records, and the ``PDDispatcher`` migrating off a decode worker that died. A worker
without ``Session`` is told by its ``Health``."""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import grpc
import pytest
import pytest_asyncio
from unit.dispatch_cluster import PROMPT, collect, running_cluster, spec, take, tokens
from unit.fake_worker import FakeWorker, FakeWorkerServicer, eventually, greedy_answer

from pdserve.core.types import PhaseOutput, PhaseRequest
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.dispatch.migration import MIGRATABLE_CODES, MigrationConfig
from pdserve.router.dispatch.workers.client import DEADLINE_EXCEEDED, WorkerCallError, WorkerClient
from pdserve.worker import servicer as servicer_module
from pdserve.worker.servicer import WorkerServicer, start_worker_server
from pdserve.worker.session import RequestFailed, WorkerSession

WAIT_S = 2.0
IDLE_S = 0.3  # the router's sessions here end this soon after their last request
ABORT_S = 0.02  # what the fake's engine abort awaits


# ---- WorkerSession alone ------------------------------------------------------------


class Steps:
    """An engine's steps: every request waiting in ``next`` wakes on the same
    ``advance``, as vLLM's output handler wakes all of a step's requests in one pass."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    async def next(self) -> None:
        await self._event.wait()

    def advance(self) -> None:
        event, self._event = self._event, asyncio.Event()
        event.set()


@dataclass
class StepRun:
    """A ``RunRequest`` on ``Steps``: request ``r`` gives ``num_outputs[r]`` (3 unless
    told) outputs, one per step (those in ``pairs``: two), the i-th with token i; those
    in ``late`` one event-loop hop after the others of their step. A cancelled one
    awaits ``abort_s`` (when set) before it ends, as vLLM's ``generate`` awaits its
    engine's abort."""

    steps: Steps
    num_outputs: dict[str, int] = field(default_factory=dict)
    late: frozenset[str] = frozenset()
    pairs: frozenset[str] = frozenset()
    abort_s: float | None = None
    started: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)

    async def __call__(self, request: pb.GenerateRequest, timeout_s: float | None
                       ) -> AsyncGenerator[pb.GenerateResponse, None]:
        rid = request.request_id
        self.started.append(rid)
        try:
            for i in range(self.num_outputs.get(rid, 3)):
                if i % 2 == 0 or rid not in self.pairs:
                    await self.steps.next()
                if rid in self.late:
                    await asyncio.sleep(0)
                yield pb.GenerateResponse(token_ids=[i])
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            if self.abort_s is not None:
                await asyncio.sleep(self.abort_s)
            raise


class Requests:
    """The router's side of a session as the worker reads it; what is queued together
    is read without a suspension in between."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[pb.SessionRequest | None] = asyncio.Queue()

    def start(self, stream_id: int, request_id: str, columns: bool = False) -> None:
        self._queue.put_nowait(pb.SessionRequest(
            stream_id=stream_id, start=pb.GenerateRequest(request_id=request_id),
            plain_columns=columns))

    def cancel(self, stream_id: int) -> None:
        self._queue.put_nowait(pb.SessionRequest(stream_id=stream_id, cancel=True))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def read(self) -> AsyncIterator[pb.SessionRequest]:
        while (msg := await self._queue.get()) is not None:
            yield msg


class Sent:
    """A ``WorkerSession``'s batches, read by a task as gRPC reads them."""

    def __init__(self, run: StepRun, requests: Requests) -> None:
        self.batches: list[pb.SessionBatch] = []
        self.task = asyncio.create_task(self._read(WorkerSession(run).serve(requests.read())))

    async def _read(self, batches: AsyncIterator[pb.SessionBatch]) -> None:
        async for batch in batches:
            self.batches.append(batch)

    def outputs(self, stream_id: int | None = None) -> list[pb.SessionOutput]:
        return [o for b in self.batches for o in b.outputs
                if stream_id is None or o.stream_id == stream_id]

    def tokens(self, stream_id: int) -> list[int]:
        """The stream's tokens as the router reads them: in each batch, its entries in
        the plain columns, then its outputs."""
        return [t for b in self.batches for t in [
            *(t for i, t in zip(b.plain_stream_ids, b.plain_token_ids, strict=True)
              if i == stream_id),
            *(t for o in b.outputs if o.stream_id == stream_id for t in o.response.token_ids)]]

    def plain(self, stream_id: int) -> int:
        """How many of the stream's outputs came in the plain columns."""
        return sum(i == stream_id for b in self.batches for i in b.plain_stream_ids)

    async def until(self, num_responses: int, num_ends: int = 0) -> None:
        def arrived() -> bool:
            outputs = self.outputs()
            return (sum(o.HasField("response") for o in outputs)
                    + sum(len(b.plain_stream_ids) for b in self.batches) == num_responses
                    and sum(o.end for o in outputs) == num_ends)
        await eventually(arrived, WAIT_S, f"{num_responses} outputs and {num_ends} ends sent")


def ended_ok(outputs: list[pb.SessionOutput]) -> bool:
    """The stream's last output, and only it, is its end, with status OK."""
    return [o.end for o in outputs].index(True) == len(outputs) - 1 and not outputs[-1].status_code


async def test_one_engine_step_is_one_batch() -> None:
    """Twelve requests woken by the same steps (a third of them one hop later): one
    batch per step, holding one output of every request, each request's in order."""
    n, steps = 12, Steps()
    run = StepRun(steps, late=frozenset(f"r{i}" for i in range(0, n, 3)))
    requests = Requests()
    sent = Sent(run, requests)
    for i in range(n):
        requests.start(i + 1, f"r{i}")
    await eventually(lambda: len(run.started) == n, WAIT_S, "every request started")
    for step in range(3):
        steps.advance()
        await sent.until(n * (step + 1), n if step == 2 else 0)

    assert len(sent.batches) == 3  # not one per output, nor one per wake-up hop
    for step, batch in enumerate(sent.batches):
        responses = [o for o in batch.outputs if o.HasField("response")]
        assert sorted(o.stream_id for o in responses) == list(range(1, n + 1))
        assert all(list(o.response.token_ids) == [step] for o in responses)
    for stream_id in range(1, n + 1):
        assert sent.tokens(stream_id) == [0, 1, 2] and ended_ok(sent.outputs(stream_id))
    requests.close()
    await asyncio.wait_for(sent.task, WAIT_S)


async def test_a_request_ending_mid_batch_leaves_the_others_running() -> None:
    steps = Steps()
    run = StepRun(steps, num_outputs={"a": 2, "b": 5, "c": 2})
    requests = Requests()
    sent = Sent(run, requests)
    requests.start(1, "a")
    requests.start(2, "b")
    await eventually(lambda: len(run.started) == 2, WAIT_S, "a and b started")
    steps.advance()
    await sent.until(2)
    steps.advance()
    await sent.until(4, 1)
    # a's last output, its end and b's output: one batch.
    assert len(sent.batches) == 2
    assert sorted((o.stream_id, o.end) for o in sent.batches[1].outputs) == [
        (1, False), (1, True), (2, False)]

    requests.start(3, "c")  # the session is still open: c runs on it beside b
    await eventually(lambda: "c" in run.started, WAIT_S, "c started")
    for num_responses, num_ends in [(6, 1), (8, 2), (9, 3)]:
        steps.advance()
        await sent.until(num_responses, num_ends)

    assert sent.tokens(1) == [0, 1] and ended_ok(sent.outputs(1))  # nothing after its end
    assert sent.tokens(2) == [0, 1, 2, 3, 4] and ended_ok(sent.outputs(2))
    assert sent.tokens(3) == [0, 1] and ended_ok(sent.outputs(3))
    assert run.cancelled == [] and not sent.task.done()
    requests.close()
    await asyncio.wait_for(sent.task, WAIT_S)


async def test_plain_outputs_of_a_stream_that_asks_go_in_the_columns_in_order() -> None:
    """a and c ask for the plain columns, b does not; c gives two outputs a step. A
    call's first output is never plain; a stream's outputs go in ``outputs`` from its
    first one there on, in a batch (c's second); each stream's tokens read in order."""
    steps = Steps()
    run = StepRun(steps, num_outputs={"a": 3, "b": 3, "c": 6}, pairs=frozenset({"c"}))
    requests = Requests()
    sent = Sent(run, requests)
    requests.start(1, "a", columns=True)
    requests.start(2, "b")
    requests.start(3, "c", columns=True)
    await eventually(lambda: len(run.started) == 3, WAIT_S, "every request started")
    for num_responses, num_ends in [(4, 0), (8, 0), (12, 3)]:
        steps.advance()
        await sent.until(num_responses, num_ends)

    first = sent.batches[0]
    assert not first.plain_stream_ids and [o.stream_id for o in first.outputs] == [1, 2, 3, 3]
    assert list(sent.batches[1].plain_stream_ids) == [1, 3, 3]  # c's third and fourth
    assert (sent.plain(1), sent.plain(2), sent.plain(3)) == (2, 0, 4)
    for stream_id, num in [(1, 3), (2, 3), (3, 6)]:
        assert sent.tokens(stream_id) == list(range(num)) and ended_ok(sent.outputs(stream_id))
    requests.close()
    await asyncio.wait_for(sent.task, WAIT_S)


@pytest.mark.parametrize("how", ["abort_at_once", "abort_awaits", "cancel_before_start"])
async def test_session_ends_after_its_last_request_is_cancelled(how: str) -> None:
    """The router cancels its last request and closes its side (``finish`` of an idle
    session): the session ends, however long the engine's abort takes, even when the
    cancel is read before the request's task first ran."""
    run = StepRun(Steps(), abort_s=ABORT_S if how == "abort_awaits" else None)
    requests = Requests()
    sent = Sent(run, requests)
    requests.start(1, "a")
    if how != "cancel_before_start":
        await eventually(lambda: run.started == ["a"], WAIT_S, "a started")
    requests.cancel(1)
    requests.close()

    await asyncio.wait_for(sent.task, WAIT_S)
    assert sent.batches == []
    assert run.cancelled == ([] if how == "cancel_before_start" else ["a"])


async def test_a_stream_id_started_twice_ends_the_session() -> None:
    """A router that starts a running stream's id again broke the protocol: no end marker
    could say which of the two it ends, so the session fails (INTERNAL: every stream on
    it is failed and migrated by the router) and what ran on it is cancelled."""
    steps = Steps()
    run = StepRun(steps)
    requests = Requests()
    sent = Sent(run, requests)
    requests.start(7, "first")
    requests.start(8, "other")
    await eventually(lambda: run.started == ["first", "other"], WAIT_S, "both started")
    requests.start(7, "again")

    with pytest.raises(RequestFailed) as failed:
        await asyncio.wait_for(sent.task, WAIT_S)
    assert failed.value.code == grpc.StatusCode.INTERNAL
    assert "stream 7 was started while it runs" in failed.value.details
    assert run.started == ["first", "other"]  # the second 7 never ran
    assert not [o for o in sent.outputs() if o.end]  # no end marker for either 7


# ---- through gRPC -------------------------------------------------------------------


class AbortAwaitingWorker(FakeWorkerServicer):
    """The scripted backend whose cancelled request awaits before it ends, as vLLM's
    ``generate`` awaits its engine's abort."""

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        try:
            async for out in super().generate(request):
                yield out
        except asyncio.CancelledError:
            await asyncio.sleep(ABORT_S)
            raise


@dataclass
class SessionSpy:
    """What the worker's sessions did: how many opened and are still open, every batch
    they sent, and each stream id's request id."""

    num_opened: int = 0
    num_open: int = 0
    batches: list[pb.SessionBatch] = field(default_factory=list)
    request_of: dict[int, str] = field(default_factory=dict)

    def session_class(self) -> type[WorkerSession]:
        spy = self

        class RecordedSession(WorkerSession):
            async def serve(self, requests: AsyncIterator[pb.SessionRequest]
                            ) -> AsyncIterator[pb.SessionBatch]:
                spy.num_opened += 1
                spy.num_open += 1
                try:
                    inner = cast(AsyncGenerator[pb.SessionBatch, None],
                                 super().serve(spy.seen(requests)))
                    async with contextlib.aclosing(inner) as sent:
                        async for batch in sent:
                            spy.batches.append(batch)
                            yield batch
                finally:
                    spy.num_open -= 1

        return RecordedSession

    async def seen(self, requests: AsyncIterator[pb.SessionRequest]
                   ) -> AsyncIterator[pb.SessionRequest]:
        async for msg in requests:
            if msg.HasField("start"):
                self.request_of[msg.stream_id] = msg.start.request_id
            yield msg


@dataclass
class Bench:
    worker: FakeWorker
    client: WorkerClient
    spy: SessionSpy
    baseline: set[asyncio.Task[object]]

    @property
    def backend(self) -> FakeWorkerServicer:
        return self.worker.servicer

    def new_tasks(self) -> set[asyncio.Task[object]]:
        """Python tasks started since the bench was set up (grpc's own are Cython's)."""
        return {t for t in asyncio.all_tasks() - self.baseline - {asyncio.current_task()}
                if isinstance(t.get_coro(), types.CoroutineType)}


@pytest_asyncio.fixture(loop_scope="function")
async def bench(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Bench]:
    """A scripted decode worker (tokens from context) and a client; its sessions spied."""
    spy = SessionSpy()
    monkeypatch.setattr(servicer_module, "WorkerSession", spy.session_class())
    backend = AbortAwaitingWorker("decode")
    backend.script.tokens_from_context = True
    serving = await start_worker_server(backend)
    worker = FakeWorker(backend, serving.server, serving.port, serving)
    client = WorkerClient(worker.endpoint, session_idle_s=IDLE_S)
    try:
        yield Bench(worker, client, spy, asyncio.all_tasks())
    finally:
        await client.close()
        await worker.stop()


def decode_request(request_id: str, prompt: tuple[int, ...], max_tokens: int) -> PhaseRequest:
    return PhaseRequest(request_id, "decode", prompt, spec(max_tokens))


async def rest(outputs: AsyncGenerator[PhaseOutput, None]) -> list[PhaseOutput]:
    """What is left of a request's outputs (within ``WAIT_S``); the iterator closed."""
    async def read() -> list[PhaseOutput]:
        return [o async for o in outputs]

    async with contextlib.aclosing(outputs):
        return await asyncio.wait_for(read(), WAIT_S)


async def answer(client: WorkerClient, request: PhaseRequest) -> list[PhaseOutput]:
    return await rest(client.generate(request, 10.0))


def token_ids(outputs: list[PhaseOutput]) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


async def test_many_requests_share_one_session_whole_and_in_order(bench: Bench) -> None:
    """24 requests of 3 to 12 tokens, all released by the same engine step: each gets
    its exact answer, all over one session, a step's outputs in one batch."""
    gate = bench.backend.script.decode_gate = asyncio.Event()
    prompts = {f"r{i}": (*PROMPT, i) for i in range(24)}
    lengths = {rid: 3 + i % 10 for i, rid in enumerate(prompts)}
    answers = {rid: asyncio.create_task(answer(
        bench.client, decode_request(rid, prompts[rid], lengths[rid]))) for rid in prompts}
    await eventually(lambda: len(bench.backend.inflight) == len(prompts), WAIT_S,
                     "every request waiting on the worker")
    gate.set()

    for rid, task in answers.items():
        outputs = await asyncio.wait_for(task, WAIT_S)
        assert token_ids(outputs) == greedy_answer(prompts[rid], lengths[rid])
        assert [o.finish_reason for o in outputs] == [None] * (lengths[rid] - 1) + ["length"]
    spy = bench.spy
    assert spy.num_opened == 1 and sorted(spy.request_of.values()) == sorted(prompts)
    # The step the gate released: every request's first token in the first batch.
    assert {spy.request_of[o.stream_id] for o in spy.batches[0].outputs} == set(prompts)
    # The tokens and the ends; every token after a request's first in the plain columns.
    num_plain = sum(len(b.plain_stream_ids) for b in spy.batches)
    num_outputs = sum(len(b.outputs) for b in spy.batches) + num_plain
    assert num_outputs == sum(lengths.values()) + len(prompts)
    # Plain: every token but the first batch's (each request's first output, and what
    # followed it there) and each request's last (it carries the finish reason).
    assert num_plain == sum(lengths.values()) - len(spy.batches[0].outputs) - len(prompts)
    assert len(spy.batches) * 4 <= num_outputs


async def test_closing_one_request_cancels_it_on_the_worker_only(bench: Bench) -> None:
    bench.backend.script.token_delay_s = 0.02
    prompts = {rid: (*PROMPT, i) for i, rid in enumerate("abc")}
    outputs = {rid: bench.client.generate(decode_request(rid, p, 40), 10.0)
               for rid, p in prompts.items()}
    for it in outputs.values():
        await asyncio.wait_for(anext(it), WAIT_S)

    await outputs["a"].aclose()
    await eventually(lambda: bench.backend.cancelled == ["a"], WAIT_S, "a cancelled on the worker")
    assert {"b", "c"} <= bench.backend.inflight  # still streaming on the same session
    for rid in "bc":
        assert token_ids(await rest(outputs[rid])) == greedy_answer(prompts[rid], 40)[1:]
    assert bench.backend.cancelled == ["a"] and bench.spy.num_opened == 1


async def test_past_its_deadline_a_request_fails_and_is_cancelled(bench: Bench) -> None:
    bench.backend.script.token_delay_s = 0.05
    num_tokens = 100  # 5 s of tokens: far past the 0.3 s deadline
    late = bench.client.generate(decode_request("late", PROMPT, num_tokens), timeout_s=0.3)
    other = asyncio.create_task(answer(bench.client, decode_request("other", (*PROMPT, 1), 20)))
    received: list[PhaseOutput] = []

    async def read_late() -> None:
        async with contextlib.aclosing(late):
            async for out in late:
                received.append(out)

    with pytest.raises(WorkerCallError) as err:
        await asyncio.wait_for(read_late(), 10 * WAIT_S)
    # The deadline cut the answer short; it did not end with the answer's last token.
    assert err.value.code == DEADLINE_EXCEEDED and len(received) < num_tokens

    await eventually(lambda: "late" in bench.backend.cancelled, WAIT_S, "late cancelled")
    assert "other" in bench.backend.inflight
    assert token_ids(await asyncio.wait_for(other, WAIT_S)) == greedy_answer((*PROMPT, 1), 20)
    (record,) = [g for g in bench.backend.generates if g.request_id == "late"]
    assert record.timeout_s is not None and 0.0 < record.timeout_s <= 0.3  # sent along
    assert bench.spy.num_opened == 1


async def test_a_worker_dying_mid_batch_fails_every_request_migratably(bench: Bench) -> None:
    bench.backend.script.token_delay_s = 0.05
    outputs = [bench.client.generate(decode_request(f"r{i}", (*PROMPT, i), 40), 10.0)
               for i in range(4)]
    for it in outputs:
        await asyncio.wait_for(anext(it), WAIT_S)
    assert bench.backend.inflight == {"r0", "r1", "r2", "r3"}

    await bench.worker.stop()
    codes = set()
    for it in outputs:
        with pytest.raises(WorkerCallError) as err:
            await rest(it)
        codes.add(err.value.code)
    assert len(codes) == 1 and codes <= MIGRATABLE_CODES, codes
    await eventually(lambda: not bench.backend.inflight, WAIT_S, "the requests ended on the worker")
    await eventually(lambda: not bench.new_tasks(), WAIT_S, "no session task left")


async def test_streams_of_a_dead_decode_worker_finish_on_the_other() -> None:
    """Through the dispatcher: the decode worker holding two of four streams dies; both
    continue on the other one, every client's tokens the uninterrupted answer."""
    max_tokens, prompts = 16, {f"r{i}": (*PROMPT, i) for i in range(4)}
    async with running_cluster(num_decode=2, migration=MigrationConfig(max_migrations=1)) as c:
        for w in (c.prefill, *c.decodes):
            w.servicer.script.tokens_from_context = True
            w.servicer.script.token_delay_s = 0.05
        chunks = {rid: c.dispatcher.generate(rid, p, spec(max_tokens))
                  for rid, p in prompts.items()}
        firsts = await asyncio.gather(*(take(it, 3) for it in chunks.values()))
        got = dict(zip(prompts, firsts, strict=True))
        victim, other = sorted(c.decodes, key=lambda d: -len(d.servicer.inflight))
        moved = set(victim.servicer.inflight)
        assert len(moved) == 2

        await victim.stop()
        ends = await asyncio.gather(*(collect(it, 5.0) for it in chunks.values()))

        for rid, end in zip(prompts, ends, strict=True):
            assert tokens(got[rid] + end) == greedy_answer(prompts[rid], max_tokens), rid
        continued = [g for g in other.servicer.generates if g.request_id in moved]
        assert {g.request_id for g in continued} == moved
        assert all(g.kv_handle is None for g in continued)
        assert sum(s.value for m in c.registry.collect() if m.name == "pdserve:migrations"
                   for s in m.samples if s.name == "pdserve:migrations_total") == len(moved)


class Registrations:
    """What ``add_WorkerServiceServicer_to_server`` registers, held back."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass

    def add_registered_method_handlers(self, service: str,
                                       handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, handlers


class OldServicer(WorkerServicer):
    """``Health`` as a worker from before ``Session`` answers it: no ``session`` there."""

    async def Health(  # noqa: N802 - gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        reply = await super().Health(request, context)
        reply.ClearField("session")
        return reply


class RefusingServicer(OldServicer):
    """Answers ``Session`` as a worker without it does (UNIMPLEMENTED), but only once it
    has read the router's first message: no write of the router's is then in flight
    when the status comes (see the xfail test below for why that matters)."""

    async def Session(  # noqa: N802 - gRPC method name
        self, request_iterator: AsyncIterator[pb.SessionRequest],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[pb.SessionBatch]:
        await anext(aiter(request_iterator))
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        yield pb.SessionBatch()  # never reached (abort raises): makes this a stream


@contextlib.asynccontextmanager
async def old_worker(refusing: bool) -> AsyncIterator[FakeWorker]:
    """A scripted decode worker from before ``Session``: the call is unknown there, or
    (``refusing``) a ``RefusingServicer``."""
    backend = FakeWorkerServicer("decode")
    backend.script.tokens_from_context = True
    server = grpc.aio.server()
    if refusing:
        pb_grpc.add_WorkerServiceServicer_to_server(RefusingServicer(backend), server)
    else:
        known = Registrations()
        pb_grpc.add_WorkerServiceServicer_to_server(OldServicer(backend), known)
        handlers = {name: h for name, h in known.handlers.items() if name != "Session"}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(known.service, handlers),))
        server.add_registered_method_handlers(known.service, handlers)
    worker = FakeWorker(backend, server, server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    try:
        yield worker
    finally:
        await worker.stop()


async def test_a_worker_without_session_is_served_over_generate() -> None:
    """The first request learns UNIMPLEMENTED and falls back; the next ones, concurrent,
    go straight to ``Generate``."""
    prompts = {f"r{i}": (*PROMPT, i) for i in range(4)}
    requests = [decode_request(rid, p, 6) for rid, p in prompts.items()]
    async with old_worker(refusing=True) as worker:
        client = WorkerClient(worker.endpoint)
        try:
            first = await answer(client, requests[0])
            then = await asyncio.gather(*(answer(client, r) for r in requests[1:]))
        finally:
            await client.close()
    for rid, outputs in zip(prompts, [first, *then], strict=True):
        assert token_ids(outputs) == greedy_answer(prompts[rid], 6)
    assert sorted(g.request_id for g in worker.servicer.generates) == sorted(prompts)


async def test_concurrent_first_requests_to_a_worker_without_session_fall_back() -> None:
    """A worker from before ``Session`` says nothing of it in ``Health``: after the pool's
    health check every request goes over ``Generate``, even the first ones, together (an
    UNIMPLEMENTED session call with writes in flight can end INTERNAL in grpc instead,
    which would fail them)."""
    prompts = {f"r{i}": (*PROMPT, i) for i in range(8)}
    async with old_worker(refusing=False) as worker:
        client = WorkerClient(worker.endpoint)
        try:
            assert (await client.health(5)).ready
            answers = await asyncio.gather(
                *(answer(client, decode_request(rid, p, 6)) for rid, p in prompts.items()),
                return_exceptions=True)
        finally:
            await client.close()
    failed = [a for a in answers if isinstance(a, BaseException)]
    assert failed == []
    for rid, outputs in zip(prompts, answers, strict=True):
        assert not isinstance(outputs, BaseException)
        assert token_ids(outputs) == greedy_answer(prompts[rid], 6)


@pytest.mark.parametrize("how", ["finished", "closed", "deadline"])
async def test_an_idle_session_ends(bench: Bench, how: str) -> None:
    """However its last request ends, a request soon after reuses the session; once it
    has been idle ``IDLE_S`` it ends on both sides (no task left), and the next request
    opens a new one."""
    bench.backend.script.token_delay_s = 0.02
    request = decode_request("r1", PROMPT, 5 if how == "finished" else 100)
    outputs = bench.client.generate(request, timeout_s=0.3 if how == "deadline" else 10.0)
    await asyncio.wait_for(anext(outputs), WAIT_S)
    with pytest.raises(WorkerCallError) if how == "deadline" else contextlib.nullcontext():
        if how == "closed":
            await outputs.aclose()
        else:
            assert len(await rest(outputs)) == 4

    again = await answer(bench.client, decode_request("r0", PROMPT, 2))  # within IDLE_S
    assert token_ids(again) == greedy_answer(PROMPT, 2) and bench.spy.num_opened == 1
    await eventually(lambda: bench.spy.num_open == 0, WAIT_S, "the worker's session ended")
    await eventually(lambda: not bench.new_tasks(), WAIT_S, "no session task left")
    assert not bench.backend.inflight and bench.spy.num_opened == 1
    again = await answer(bench.client, decode_request("r2", PROMPT, 3))
    assert token_ids(again) == greedy_answer(PROMPT, 3) and bench.spy.num_opened == 2


async def test_a_client_closed_with_grace_lets_its_running_requests_finish(bench: Bench
                                                                          ) -> None:
    """A worker that left the router's view is closed with a grace (it drains what it
    runs): the session's request finishes whole; without grace it would be cancelled."""
    bench.backend.script.token_delay_s = 0.02
    outputs = bench.client.generate(decode_request("r1", PROMPT, 10), timeout_s=10.0)
    first = await asyncio.wait_for(anext(outputs), WAIT_S)
    closing = asyncio.create_task(bench.client.close(grace_s=5.0))
    got = [first, *await rest(outputs)]
    await asyncio.wait_for(closing, WAIT_S)
    assert token_ids(got) == greedy_answer(PROMPT, 10)
    assert "r1" not in bench.backend.cancelled
