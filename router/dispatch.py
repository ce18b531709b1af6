"""Runs a request on the workers: prefill on P (first token + KV handle), then
decode on D with the handle; falls back to decode alone when prefill fails.

Cleanup is owned here: however the chunk iterator ends (finished, closed by the
HTTP layer, cancelled), the gRPC calls are cancelled and each worker involved is
told to abort, which also releases the KV blocks prefill holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Sequence

import grpc
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from prometheus_client import CollectorRegistry, Counter

from .placement import Choice, Placement, PlacementRequest
from .prefix_routing import PrefixRouting
from .types import NoWorkerAvailableError, SamplingSpec, TokenChunk, WorkerFailedError
from .workers import WorkerClient, WorkerPool

logger = logging.getLogger("pdserve.router.dispatch")

_FINISH = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_ERROR: "error",
}
_ABORT_TIMEOUT_S = 5.0
# Only "cannot reach" takes a worker out of placement; a slow request's deadline does not.
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE}


class DispatchMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.fallbacks = Counter(
            "pdserve_dispatch_prefill_fallbacks", "Requests whose prompt decode computed "
            "itself because no prefill worker could serve.", registry=registry)
        self.worker_errors = Counter(
            "pdserve_dispatch_worker_errors", "Failed worker calls, by role and status.",
            ["role", "code"], registry=registry)
        self.handoffs = Counter(
            "pdserve_dispatch_kv_handoffs", "Requests whose KV went from prefill to decode.",
            registry=registry)


def _sampling_pb(spec: SamplingSpec, max_tokens: int) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=max_tokens, temperature=spec.temperature, top_p=spec.top_p,
        top_k=spec.top_k, stop_token_ids=spec.stop_token_ids, ignore_eos=spec.ignore_eos)
    if spec.seed is not None:
        msg.seed = spec.seed
    return msg


def _push_target(prefill: WorkerClient, decode: WorkerClient) -> pb.KvPushTarget | None:
    """Have prefill push the KV layer by layer to decode, when both support it."""
    p, d = prefill.state, decode.state
    if not (p.kv_push and d.kv_push and d.kv_port):
        return None
    return pb.KvPushTarget(host=d.kv_host, port=d.kv_port, transfer_id=uuid.uuid4().hex)


class PDDispatcher:
    def __init__(
        self, pool: WorkerPool, placement: Placement, registry: CollectorRegistry,
        request_timeout_s: float = 600.0, prefix: PrefixRouting | None = None,
    ) -> None:
        self._pool = pool
        self._placement = placement
        self._prefix = prefix
        self._metrics = DispatchMetrics(registry)
        self._timeout = request_timeout_s
        self._cursor = 0
        self._cleanups: set[asyncio.Task[None]] = set()

    def is_ready(self) -> bool:
        return any(w.state.healthy for w in self._pool.decode)

    def _choose(self, prompt: Sequence[int]) -> tuple[
            WorkerClient | None, WorkerClient, PlacementRequest]:
        request = (self._prefix.request(prompt) if self._prefix is not None
                   else PlacementRequest(len(prompt)))
        choice: Choice | None = self._placement.choose(
            [w.state for w in self._pool.prefill], [w.state for w in self._pool.decode],
            self._cursor, request)
        self._cursor += 1
        if choice is None:
            raise NoWorkerAvailableError("no healthy decode worker is available")
        prefill = self._pool.prefill[choice.prefill] if choice.prefill is not None else None
        if prefill is not None and self._prefix is not None:
            self._prefix.on_placed(request, prefill.state)
        return prefill, self._pool.decode[choice.decode], request

    async def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec
    ) -> AsyncIterator[TokenChunk]:
        prefill, decode, placed = self._choose(prompt_token_ids)
        involved: list[WorkerClient] = []
        finished = False
        try:
            first: pb.GenerateResponse | None = None
            if prefill is not None:
                involved.append(prefill)
                first = await self._prefill(prefill, request_id, prompt_token_ids, sampling,
                                            _push_target(prefill, decode),
                                            placed.uncached_tokens(prefill.state))
            if first is None:
                self._metrics.fallbacks.inc()
                decode_prompt, handle = list(prompt_token_ids), None
                max_tokens = sampling.max_tokens
            else:
                finish = _FINISH.get(first.finish_reason)
                t1 = list(first.token_ids)
                done = finish in ("stop", "abort", "error") or sampling.max_tokens <= 1
                yield TokenChunk(tuple(t1), finish if done else None, first.num_cached_tokens)
                if done:  # nothing is held: prefill keeps KV only for a decode to come
                    finished = True
                    return
                decode_prompt = list(prompt_token_ids) + t1
                handle = first.kv_handle if first.HasField("kv_handle") else None
                max_tokens = sampling.max_tokens - len(t1)
                if handle is not None:
                    self._metrics.handoffs.inc()
            involved.append(decode)
            stream = self._decode(decode, request_id, decode_prompt, handle, sampling,
                                  max_tokens, first is None, involved)
            async with contextlib.aclosing(stream):  # closing us closes the decode call now
                async for chunk in stream:
                    if chunk.finish_reason is not None:
                        finished = True
                    yield chunk
        finally:
            if not finished:
                self._abort_later(request_id, involved)

    async def _prefill(
        self, worker: WorkerClient, request_id: str, prompt: Sequence[int], spec: SamplingSpec,
        push_to: pb.KvPushTarget | None,
        uncached_tokens: int,
    ) -> pb.GenerateResponse | None:
        """The prefill's one response, or None if prefill failed (decode falls back)."""
        req = pb.GenerateRequest(request_id=request_id, phase=pb.PHASE_PREFILL,
                                 prompt_token_ids=prompt,
                                 sampling=_sampling_pb(spec, spec.max_tokens))
        if push_to is not None:
            req.kv_push_target.CopyFrom(push_to)
        worker.state.num_assigned += 1
        worker.state.num_assigned_tokens += uncached_tokens
        try:
            last: pb.GenerateResponse | None = None
            async for resp in worker.stub.Generate(req, timeout=self._timeout):
                last = resp
            if last is not None and self._prefix is not None:
                self._prefix.on_prefilled(last.num_cached_tokens)
            return last
        except grpc.aio.AioRpcError as exc:
            self._on_error(worker, exc)
            if exc.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise WorkerFailedError(f"prefill rejected the request: {exc.details()}") from exc
            return None
        finally:
            worker.state.num_assigned -= 1
            worker.state.num_assigned_tokens -= uncached_tokens

    async def _decode(
        self, worker: WorkerClient, request_id: str, prompt: list[int],
        handle: pb.KvHandle | None, spec: SamplingSpec, max_tokens: int, first_chunk: bool,
        involved: list[WorkerClient],
    ) -> AsyncIterator[TokenChunk]:
        """Decode on ``worker``; if it is unreachable before its first token (it died
        and membership has not caught up yet), once more on another compatible one."""
        req = pb.GenerateRequest(request_id=request_id, phase=pb.PHASE_DECODE,
                                 prompt_token_ids=prompt, sampling=_sampling_pb(spec, max_tokens))
        if handle is not None:
            req.kv_handle.CopyFrom(handle)
        current: WorkerClient | None = worker
        retries = 1
        while current is not None:
            worker, current, started = current, None, False
            worker.state.num_assigned += 1
            call = worker.stub.Generate(req, timeout=self._timeout)
            try:
                async for resp in call:
                    started = True
                    cached = resp.num_cached_tokens if first_chunk else None
                    first_chunk = False
                    yield TokenChunk(tuple(resp.token_ids), _FINISH.get(resp.finish_reason),
                                     cached)
            except grpc.aio.AioRpcError as exc:
                self._on_error(worker, exc)
                if started or exc.code() not in _UNREACHABLE or not retries:
                    raise WorkerFailedError(f"decode worker failed: {exc.details()}") from exc
                retries, current = retries - 1, self._other_decode(worker)
                if current is None:
                    raise WorkerFailedError(f"decode worker failed: {exc.details()}") from exc
                involved.append(current)
                if req.HasField("kv_handle"):  # the KV was pushed to the dead one: pull it
                    req.kv_handle.pushed = False
            finally:
                worker.state.num_assigned -= 1
                call.cancel()

    def _other_decode(self, failed: WorkerClient) -> WorkerClient | None:
        """A healthy decode worker that can load the same KV as ``failed``."""
        for w in self._pool.decode:
            if w is not failed and w.state.healthy and (
                    w.state.compatibility_hash == failed.state.compatibility_hash):
                return w
        return None

    def _on_error(self, worker: WorkerClient, exc: grpc.aio.AioRpcError) -> None:
        self._metrics.worker_errors.labels(worker.state.role, exc.code().name).inc()
        logger.warning("%s worker %s: %s %s", worker.state.role, worker.state.endpoint,
                       exc.code().name, exc.details())
        if exc.code() in _UNREACHABLE:
            worker.mark_unhealthy(exc.code().name)

    def _abort_later(self, request_id: str, workers: list[WorkerClient]) -> None:
        """Abort on every worker involved, from a task of its own: this runs while
        the request's own task is being cancelled."""
        task = asyncio.get_running_loop().create_task(self._abort(request_id, workers))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanups.discard)

    async def _abort(self, request_id: str, workers: list[WorkerClient]) -> None:
        await asyncio.gather(*(self._abort_one(request_id, w) for w in workers))

    async def _abort_one(self, request_id: str, worker: WorkerClient) -> None:
        try:
            await worker.stub.Abort(pb.AbortRequest(request_id=request_id),
                                    timeout=_ABORT_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            logger.warning("abort of %s on %s failed: %s", request_id,
                           worker.state.endpoint, exc.code().name)
