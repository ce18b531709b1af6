"""A scripted gRPC ``WorkerService`` for router tests: real ``grpc.aio`` server on 127.0.0.1,
no engine. It records what the router sent (Generate, Abort, client cancellations) and
plays a ``WorkerScript``:

- prefill: one token, finish LENGTH with a ``KvHandle`` (a lease, kept until Abort) when
  ``sampling.max_tokens > 1``, or finish STOP without a handle when ``prefill_stop``;
- decode: ``sampling.max_tokens`` tokens, one per message, ``token_delay_s`` apart, the last
  one with finish LENGTH (after ``decode_gate``, if any, is set);
- ``fail_code`` fails Generate with that status, after ``fail_after_tokens`` messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc

_PHASES = {pb.PHASE_PREFILL: "prefill", pb.PHASE_DECODE: "decode"}
_ROLES = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}


@dataclass
class WorkerScript:
    """What the fake does; mutable, so a test can change it while the server runs."""

    first_token_id: int = 42
    prefill_stop: bool = False
    decode_token_ids: Sequence[int] = (100, 101, 102, 103, 104, 105, 106, 107)
    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0
    # Decode waits for this event (when set) before its first token.
    decode_gate: asyncio.Event | None = None
    num_cached_tokens: int = 0
    fail_code: grpc.StatusCode | None = None
    fail_after_tokens: int = 0
    compatibility_hash: str = "compat-a"
    # Advertise layer-wise KV push, with this KV port.
    kv_push: bool = False
    kv_port: int = 0


@dataclass(frozen=True)
class GenerateRecord:
    request_id: str
    phase: str
    prompt_token_ids: tuple[int, ...]
    kv_handle: pb.KvHandle | None
    max_tokens: int
    kv_push_target: pb.KvPushTarget | None = None


@dataclass
class FakeWorkerServicer(pb_grpc.WorkerServiceServicer):
    role: str
    script: WorkerScript = field(default_factory=WorkerScript)
    generates: list[GenerateRecord] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    inflight: set[str] = field(default_factory=set)
    # Prefill only: request id -> transfer id of the KV handle it holds until Abort.
    leases: dict[str, str] = field(default_factory=dict)

    def phases(self) -> list[str]:
        return [g.phase for g in self.generates]

    async def Generate(  # noqa: N802 - gRPC method name
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        phase = _PHASES.get(request.phase, "")
        handle = request.kv_handle if request.HasField("kv_handle") else None
        push = request.kv_push_target if request.HasField("kv_push_target") else None
        self.generates.append(GenerateRecord(
            request.request_id, phase, tuple(request.prompt_token_ids), handle,
            request.sampling.max_tokens, push))
        if phase != self.role:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"a {self.role} worker")
        self.inflight.add(request.request_id)
        try:
            steps = self._prefill(request) if phase == "prefill" else self._decode(request)
            fail = self.script.fail_code
            num_sent = 0
            async with contextlib.aclosing(steps):
                async for resp in steps:
                    if fail is not None and num_sent >= self.script.fail_after_tokens:
                        break
                    yield resp
                    num_sent += 1
            if fail is not None:
                await context.abort(fail, f"scripted {phase} failure")
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.inflight.discard(request.request_id)

    async def _prefill(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        await asyncio.sleep(self.script.prefill_delay_s)
        resp = pb.GenerateResponse(
            token_ids=[self.script.first_token_id], finish_reason=pb.FINISH_REASON_LENGTH,
            num_cached_tokens=self.script.num_cached_tokens,
            num_prompt_tokens=len(request.prompt_token_ids))
        if self.script.prefill_stop:
            resp.finish_reason = pb.FINISH_REASON_STOP
        elif request.sampling.max_tokens > 1:
            transfer_id = f"xfer-{request.request_id}"
            resp.kv_handle.CopyFrom(pb.KvHandle(
                engine_id=f"engine-{id(self):x}", remote_request_id=f"p-{request.request_id}",
                block_ids=[3, 4], num_tokens=len(request.prompt_token_ids), transport="tcp",
                host="127.0.0.1", port=1, transfer_id=transfer_id,
                lease_deadline_unix_ns=time.time_ns() + 30 * 10**9))
            self.leases[request.request_id] = transfer_id
        yield resp

    async def _decode(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        ids = self.script.decode_token_ids
        n = request.sampling.max_tokens
        if self.script.decode_gate is not None:
            await self.script.decode_gate.wait()
        for i in range(n):
            await asyncio.sleep(self.script.token_delay_s)
            last = i == n - 1
            yield pb.GenerateResponse(
                token_ids=[ids[i % len(ids)]],
                finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED,
                num_cached_tokens=self.script.num_cached_tokens if i == 0 else 0,
                num_prompt_tokens=len(request.prompt_token_ids) if last else 0)

    async def Abort(  # noqa: N802 - gRPC method name
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        self.aborts.append(request.request_id)
        found = request.request_id in self.inflight or request.request_id in self.leases
        self.leases.pop(request.request_id, None)
        return pb.AbortResponse(found=found)

    async def Health(  # noqa: N802 - gRPC method name
        self, request: pb.HealthRequest, context: grpc.aio.ServicerContext
    ) -> pb.HealthResponse:
        return pb.HealthResponse(
            ready=True, role=_ROLES[self.role], worker_id=f"fake-{self.role}-{id(self):x}",
            model="fake", dtype="float32", block_size=128, max_model_len=4096,
            transport="tcp", compatibility_hash=self.script.compatibility_hash,
            kv_host="127.0.0.1", kv_port=self.script.kv_port, kv_push=self.script.kv_push)

    async def GetLoad(  # noqa: N802 - gRPC method name
        self, request: pb.GetLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.GetLoadResponse:
        return pb.GetLoadResponse()


@dataclass
class FakeWorker:
    servicer: FakeWorkerServicer
    server: grpc.aio.Server
    port: int

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop serving at once (in-flight calls are cancelled): a dead worker."""
        await self.server.stop(grace=None)


async def start_fake_worker(role: str, script: WorkerScript | None = None) -> FakeWorker:
    servicer = FakeWorkerServicer(role, script or WorkerScript())
    server = grpc.aio.server()
    pb_grpc.add_WorkerServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return FakeWorker(servicer, server, port)


async def eventually(
    condition: Callable[[], bool], timeout_s: float = 2.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.01)
