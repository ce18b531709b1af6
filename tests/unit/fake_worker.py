"""A scripted worker for router tests: the real gRPC ``WorkerService``
(``pdserve.worker.servicer``) on 127.0.0.1 in front of a scripted ``WorkerBackend``,
no engine. The backend records what the router sent (Generate, Abort, client
cancellations) and plays a ``WorkerScript``:

- prefill: one token, finish LENGTH with a ``KvHandle`` (a lease, kept until Abort) when
  ``sampling.max_tokens > 1``, or finish STOP without a handle when ``prefill_stop``;
- decode: ``sampling.max_tokens`` tokens, one per message, ``token_delay_s`` apart, the last
  one with finish LENGTH (after ``decode_gate``, if any, is set);
- ``fail_code`` fails Generate with that status, after ``fail_after_tokens`` messages;
  ``fail_finish`` ends it instead with an output finishing ``error``/``abort``;
- ``tokens_from_context``: each token (prefill's too) is ``context_token`` of the whole
  context before it (prompt + tokens so far), as a greedy engine's is, so a continuation
  from any point gives the uninterrupted sequence and a repeated or dropped token shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.core.bounded import bounded
from pdserve.core.handle import KVHandle, PoolSource, PushTarget
from pdserve.core.lora import LoraAdapter
from pdserve.core.types import (
    FinishReason,
    PhaseOutput,
    PhaseRequest,
    PhaseTiming,
    Role,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.core.weight_calls import WeightCall
from pdserve.worker.backend import WorkerError
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.servicer import STATUS_OF_KIND, WorkerServer, start_worker_server

_KIND_OF_STATUS = {code: kind for kind, code in STATUS_OF_KIND.items()}

@dataclass
class WorkerScript:
    """What the fake does; mutable, so a test can change it while the server runs."""

    first_token_id: int = 42
    # Started without --enable-lora: its LoRA calls answer FAILED_PRECONDITION.
    lora_off: bool = False
    prefill_stop: bool = False
    decode_token_ids: Sequence[int] = (100, 101, 102, 103, 104, 105, 106, 107)
    prefill_delay_s: float = 0.0
    token_delay_s: float = 0.0
    # Decode waits for this event (when set) before its first token.
    decode_gate: asyncio.Event | None = None
    num_cached_tokens: int = 0
    fail_code: grpc.StatusCode | None = None
    fail_finish: FinishReason | None = None
    fail_after_tokens: int = 0
    tokens_from_context: bool = False
    compatibility_hash: str = "compat-a"
    model: str = "fake"  # the served model its Health reports
    # Advertise layer-wise KV push, with this KV port.
    kv_push: bool = False
    kv_port: int = 0
    # Sent on the last output of each call, as a worker that measures its phases does.
    timing: PhaseTiming | None = None
    # Prefill: report the leases it holds as pending transfers (a drain waits for them).
    leases_pending: bool = False
    # The cluster KV store its Health names ("": none), and a block's lifetime there.
    kv_store_id: str = ""
    kv_store_ttl_s: float = 0.0
    weight_version: str = "default"  # the weights version its Health reports

STOP_TIMEOUT_S = 5.0


def context_token(context: Sequence[int]) -> int:
    """The fake's "greedy" next token: a function of the whole context before it."""
    return 1000 + zlib.crc32(b",".join(b"%d" % t for t in context)) % 30000


def greedy_answer(prompt: Sequence[int], num_tokens: int) -> list[int]:
    """What an uninterrupted ``tokens_from_context`` request answers."""
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(context_token(context))
    return context[len(prompt):]


@dataclass(frozen=True)
class GenerateRecord:
    request_id: str
    phase: str
    prompt_token_ids: tuple[int, ...]
    kv_handle: KVHandle | None
    max_tokens: int
    kv_push_target: PushTarget | None = None
    timeout_s: float | None = None  # the call's gRPC deadline, as time left on arrival
    num_output_in_prompt: int = 0
    prompt_logprobs: int | None = None
    pool_source: PoolSource | None = None
    weight_version: str = ""


@dataclass
class FakeWorkerServicer:
    """The scripted ``WorkerBackend`` (named for what router tests reach it as:
    ``FakeWorker.servicer``). The servicer refuses a phase not of ``role`` before
    the backend sees it, as it does for every worker."""

    role: Role
    script: WorkerScript = field(default_factory=WorkerScript)
    generates: list[GenerateRecord] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    inflight: set[str] = field(default_factory=set)
    # Prefill only: request id -> transfer id of the KV handle it holds until Abort.
    leases: dict[str, str] = field(default_factory=dict)
    # Its id, fixed at creation (a role switch keeps it).
    worker_id: str = ""
    # Roles it was switched to (``set_role``), and whether a drain ran out (its gated
    # decodes then end ``abort``, its leases are released).
    role_switches: list[Role] = field(default_factory=list)
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    # The LoRA adapters it serves (LoadLoraAdapter; a path under /bad is refused).
    loras: dict[str, LoraAdapter] = field(default_factory=dict)
    lora_calls: int = 0  # LoadLoraAdapter and UnloadLoraAdapter calls it answered
    lora_refusals: int = 0  # requests refused: their adapter's folder is not the one served

    def __post_init__(self) -> None:
        self.worker_id = self.worker_id or f"fake-{self.role}-{id(self):x}"

    def phases(self) -> list[str]:
        return [g.phase for g in self.generates]

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        rid, phase = request.request_id, request.phase
        self._check_lora(request)
        self.generates.append(GenerateRecord(
            rid, phase, request.prompt_token_ids, request.kv_handle,
            request.sampling.max_tokens, request.push_target, request.timeout_s,
            request.num_output_in_prompt, request.sampling.prompt_logprobs,
            request.pool_source, request.weight_version))
        self.inflight.add(rid)
        try:
            steps = self._prefill(request) if phase == "prefill" else self._decode(request)
            fail, finish = self.script.fail_code, self.script.fail_finish
            failing = fail is not None or finish is not None
            num_sent = 0
            async with contextlib.aclosing(steps):
                async for out in steps:
                    if failing and num_sent >= self.script.fail_after_tokens:
                        break
                    yield out
                    num_sent += 1
            if fail is not None:
                raise WorkerError(_KIND_OF_STATUS[fail], f"scripted {phase} failure")
            if finish is not None:
                yield PhaseOutput(token_ids=(), finish_reason=finish)
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled inside the backend, or closed by the servicer at a yield.
            self.cancelled.append(rid)
            raise
        finally:
            self.inflight.discard(rid)

    async def _prefill(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        await asyncio.sleep(self.script.prefill_delay_s)
        handle = None
        if not self.script.prefill_stop and request.sampling.max_tokens > 1:
            transfer_id = f"xfer-{request.request_id}"
            handle = KVHandle(
                engine_id=f"engine-{id(self):x}", remote_request_id=f"p-{request.request_id}",
                block_ids=(3, 4), num_tokens=len(request.prompt_token_ids), transport="tcp",
                host="127.0.0.1", port=1, transfer_id=transfer_id,
                lease_deadline_unix_ns=time.time_ns() + 30 * 10**9)
            self.leases[request.request_id] = transfer_id
        first = (context_token(request.prompt_token_ids) if self.script.tokens_from_context
                 else self.script.first_token_id)
        yield PhaseOutput(
            token_ids=(first,),
            finish_reason="stop" if self.script.prefill_stop else "length", kv_handle=handle,
            num_cached_tokens=self.script.num_cached_tokens,
            num_prompt_tokens=len(request.prompt_token_ids), timing=self.script.timing)

    async def _decode(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        ids = self.script.decode_token_ids
        n = request.sampling.max_tokens
        context = list(request.prompt_token_ids)
        if self.script.decode_gate is not None:
            gate, ended = (asyncio.ensure_future(e.wait())
                           for e in (self.script.decode_gate, self.ended))
            await asyncio.wait([gate, ended], return_when=asyncio.FIRST_COMPLETED)
            gate.cancel()
            ended.cancel()
            if self.ended.is_set():
                yield PhaseOutput(token_ids=(), finish_reason="abort")
                return
        for i in range(n):
            await asyncio.sleep(self.script.token_delay_s)
            last = i == n - 1
            token = (context_token(context) if self.script.tokens_from_context
                     else ids[i % len(ids)])
            context.append(token)
            yield PhaseOutput(
                token_ids=(token,), finish_reason="length" if last else None,
                num_cached_tokens=self.script.num_cached_tokens if i == 0 else 0,
                num_prompt_tokens=len(request.prompt_token_ids) if last else 0,
                timing=self.script.timing if last else None)

    async def abort(self, request_id: str) -> bool:
        self.aborts.append(request_id)
        found = request_id in self.inflight or request_id in self.leases
        self.leases.pop(request_id, None)
        return found

    def health(self) -> WorkerHealth:
        return WorkerHealth(
            ready=True, role=self.role,
            worker_id=self.worker_id, model=self.script.model, dtype="float32",
            block_size=128, max_model_len=4096, transport="tcp",
            compatibility_hash=self.script.compatibility_hash, kv_host="127.0.0.1",
            kv_port=self.script.kv_port, kv_push=self.script.kv_push,
            kv_store_id=self.script.kv_store_id, kv_store_ttl_s=self.script.kv_store_ttl_s,
            loras=tuple(self.loras.values()),
            weight_version=self.script.weight_version)

    def _check_lora(self, request: PhaseRequest) -> None:
        """As ``worker/lora.LoraTable``: an adapter it does not serve is INVALID_ARGUMENT,
        one it serves from another folder ABORTED (counted in ``lora_refusals``)."""
        name, path = request.sampling.lora_name, request.sampling.lora_path
        if name is None:
            return
        served = self.loras.get(name)
        if served is None:
            raise WorkerError("invalid_argument", f"serves no LoRA adapter {name!r}")
        if path is not None and served.path != path:
            self.lora_refusals += 1
            raise WorkerError("aborted", f"serves LoRA {name!r} from another folder")

    async def load_lora(self, adapter: LoraAdapter) -> bool:
        self.lora_calls += 1
        if self.script.lora_off:
            raise WorkerError("failed_precondition", "LoRA is off on this worker")
        if adapter.path.startswith("/bad"):
            raise ValueError(f"cannot load LoRA adapter {adapter.name!r}: no such folder")
        changed = self.loras.get(adapter.name) != adapter
        self.loras[adapter.name] = adapter
        return changed

    async def unload_lora(self, name: str) -> bool:
        self.lora_calls += 1
        if self.script.lora_off:
            raise WorkerError("failed_precondition", "LoRA is off on this worker")
        return self.loras.pop(name, None) is not None

    # Its weights never change (``WeightsBackend``: unimplemented here).
    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        raise WorkerError("unimplemented", "this worker's weights cannot change in place")

    async def commit_weights(self, version: str) -> None:
        raise WorkerError("unimplemented", "this worker's weights cannot change in place")

    async def discard_weights(self) -> bool:
        raise WorkerError("unimplemented", "this worker's weights cannot change in place")

    async def engine_weight_call(self, call: WeightCall) -> str:
        raise WorkerError("unimplemented", "this worker's weights cannot change in place")

    async def load(self) -> WorkerLoadReport:
        return WorkerLoadReport(num_pending_transfers=len(self.leases)
                                if self.script.leases_pending else 0)

    def kv_mirror(self) -> KvCacheMirror | None:
        return None

    def set_role(self, role: Role) -> None:
        self.role_switches.append(role)
        self.role = role

    async def end_role_work(self) -> tuple[int, int]:
        self.ended.set()  # gated decodes end ``abort``
        aborted = sorted(self.inflight)
        self.aborts += aborted
        released = len(self.leases)
        self.leases.clear()
        return len(aborted), released


@dataclass
class FakeWorker:
    servicer: FakeWorkerServicer
    server: grpc.aio.Server
    port: int
    serving: WorkerServer | None = None  # its health service and drain

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        """Stop serving at once (in-flight calls are cancelled): a dead worker. Bounded:
        a test must not hang on a server whose shutdown never completes."""
        with contextlib.suppress(TimeoutError):
            await bounded(self.server.stop(grace=None), STOP_TIMEOUT_S)


async def start_fake_worker(role: Role, script: WorkerScript | None = None) -> FakeWorker:
    backend = FakeWorkerServicer(role, script or WorkerScript())
    serving = await start_worker_server(backend)
    return FakeWorker(backend, serving.server, serving.port, serving)


async def eventually(
    condition: Callable[[], bool], timeout_s: float = 2.0, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        await asyncio.sleep(0.01)
