"""The worker's gRPC servicer, round trip over a real ``grpc.aio`` server on
127.0.0.1 with a fake backend: messages convert both ways, each refusal and
error becomes its status, a cancelled call ends the backend's stream, and the
KV-event relay. The client is the router's adapter (``router.worker_client``), so
this is also the round trip through both gRPC adapters and the conversion layer.
What the typed client cannot send (an unspecified phase) is in ``test_convert.py``."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from typing import cast

import pytest
import pytest_asyncio

from pdserve.core.handle import KVHandle, PushTarget
from pdserve.core.types import (
    KvChange,
    KvSnapshot,
    PhaseOutput,
    PhaseRequest,
    SamplingSpec,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient
from pdserve.worker.backend import WorkerBackend, WorkerError
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.servicer import start_worker_server

HANDLE = KVHandle("p0", "r1-x", (3, 4), 4, "tcp", "127.0.0.1", 7001, "x-1", 123, pushed=True)
# Sampling floats travel as float32: these are exact there.
REQUEST = PhaseRequest("r1", "decode", (1, 2, 3, 4, 9), SamplingSpec(4, 0.5, 0.75, 5, 7, (2,)),
                       kv_handle=HANDLE, push_target=PushTarget("h", 1, "t"))


@dataclass
class Backend:
    """A ``WorkerBackend`` that plays ``outputs`` then raises ``error`` (if any)."""

    health_: WorkerHealth = field(default_factory=lambda: WorkerHealth(
        True, "decode", "w0", model="m", max_model_len=64, kv_push=True))
    outputs: Sequence[PhaseOutput] = ()
    error: Exception | None = None
    hang: bool = False
    mirror: KvCacheMirror | WorkerError | None = None
    requests: list[PhaseRequest] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        self.requests.append(request)
        try:
            for out in self.outputs:
                yield out
            if self.hang:
                await asyncio.Event().wait()
            if self.error is not None:
                raise self.error
        except (asyncio.CancelledError, GeneratorExit):
            # Cancelled while waiting here, or closed by the servicer at a yield.
            self.closed.append(request.request_id)
            raise

    async def abort(self, request_id: str) -> bool:
        self.aborts.append(request_id)
        return request_id == "r1"

    def health(self) -> WorkerHealth:
        return self.health_

    async def load(self) -> WorkerLoadReport:
        return WorkerLoadReport(num_running_reqs=2, kv_cache_usage=0.5, kv_loads=3)

    def kv_mirror(self) -> KvCacheMirror | None:
        if isinstance(self.mirror, WorkerError):
            raise self.mirror
        return self.mirror


TIMEOUT_S = 10.0
# gRPC's timeout header is rounded up (to 100 ms at 10 s): the backend may see that much more.
WIRE_SLACK_S = 0.11


@dataclass
class Served:
    backend: Backend
    client: WorkerClient

    async def generate(self, req: PhaseRequest) -> list[PhaseOutput]:
        return [out async for out in self.client.generate(req, TIMEOUT_S)]


@pytest_asyncio.fixture(loop_scope="function")
async def served() -> AsyncIterator[Served]:
    backend = Backend()
    worker = await start_worker_server(cast(WorkerBackend, backend))
    client = WorkerClient(f"127.0.0.1:{worker.port}")
    yield Served(backend, client)
    await client.close()
    await worker.server.stop(None)


async def test_generate_round_trip(served: Served) -> None:
    outs = [PhaseOutput((5,)), PhaseOutput((6, 7), "length", HANDLE, 2, 5)]
    served.backend.outputs = outs
    assert await served.generate(REQUEST) == outs
    (seen,) = served.backend.requests
    assert replace(seen, timeout_s=None) == REQUEST
    # The call's gRPC deadline reaches the backend as the time it has left.
    assert seen.timeout_s is not None and 0 < seen.timeout_s <= TIMEOUT_S + WIRE_SLACK_S
    assert served.backend.closed == []


async def test_health_load_and_abort_round_trip(served: Served) -> None:
    assert await served.client.health(TIMEOUT_S) == served.backend.health_
    assert await served.client.load(TIMEOUT_S) == await served.backend.load()
    assert await served.client.abort("r1", TIMEOUT_S)
    assert not await served.client.abort("r2", TIMEOUT_S)
    assert served.backend.aborts == ["r1", "r2"]


async def expect_status(served: Served, req: PhaseRequest, code: str,
                        text: str) -> list[PhaseOutput]:
    got: list[PhaseOutput] = []
    with pytest.raises(WorkerCallError) as err:
        async for out in served.client.generate(req, TIMEOUT_S):
            got.append(out)
    assert err.value.code == code
    assert text in err.value.details
    return got


async def test_refusals_before_the_backend_sees_the_request(served: Served) -> None:
    prefill = PhaseRequest("r1", "prefill", (1,), SamplingSpec(2))
    await expect_status(served, prefill, "FAILED_PRECONDITION", "decode worker")
    too_long = PhaseRequest("r1", "decode", (1,) * 60, SamplingSpec(5))
    await expect_status(served, too_long, "INVALID_ARGUMENT", "max_model_len")
    no_id = PhaseRequest("", "decode", (1,), SamplingSpec(5))
    await expect_status(served, no_id, "INVALID_ARGUMENT", "request_id")
    served.backend.health_ = WorkerHealth(False, "decode", "w0", max_model_len=64)
    await expect_status(served, REQUEST, "UNAVAILABLE", "loading")
    assert served.backend.requests == []


@pytest.mark.parametrize(("error", "code", "text"), [
    (WorkerError("unavailable", "scripted"), "UNAVAILABLE", "scripted"),
    (ValueError("bad handle"), "INVALID_ARGUMENT", "bad handle"),
    (RuntimeError("boom"), "INTERNAL", "RuntimeError: boom"),
])
async def test_backend_errors_map_to_status_after_the_outputs_so_far(
        served: Served, error: Exception, code: str, text: str) -> None:
    served.backend.outputs, served.backend.error = [PhaseOutput((5,))], error
    assert await expect_status(served, REQUEST, code, text) == [PhaseOutput((5,))]


async def test_a_cancelled_call_ends_the_backend_stream(served: Served) -> None:
    served.backend.outputs, served.backend.hang = [PhaseOutput((5,))], True
    stream = served.client.generate(REQUEST, TIMEOUT_S)
    assert (await anext(stream)).token_ids == (5,)
    await stream.aclose()
    for _ in range(200):
        if served.backend.closed:
            break
        await asyncio.sleep(0.01)
    assert served.backend.closed == ["r1"]


async def test_kv_events_relay(served: Served) -> None:
    for mirror, code in [(None, "UNIMPLEMENTED"),
                         (WorkerError("unavailable", "loading"), "UNAVAILABLE")]:
        served.backend.mirror = mirror
        with pytest.raises(WorkerCallError) as err:
            await served.client.kv_snapshot(TIMEOUT_S)
        assert err.value.code == code
        with pytest.raises(WorkerCallError) as err:
            await anext(served.client.kv_events())
        assert err.value.code == code
    live = KvCacheMirror(block_size=4)
    live.apply(False, [10, 11], [])
    served.backend.mirror = live
    assert await served.client.kv_snapshot(TIMEOUT_S) == KvSnapshot(1, (10, 11), 4, "w0")
    events = served.client.kv_events()
    assert await anext(events) == KvChange(1)  # heartbeat first
    live.apply(False, [12], [10])
    assert await anext(events) == KvChange(2, False, (12,), (10,))
    await events.aclose()
