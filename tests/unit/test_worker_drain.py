"""A worker's serving state and drain: the standard ``grpc.health.v1`` service says
SERVING, then NOT_SERVING once draining; a draining worker refuses new ``Generate`` calls
with UNAVAILABLE, answers not ready to the router's health loop (which stops placing
there), finishes the calls in flight, and stops within its drain timeout. In process
with the scripted fake worker, and as a real ``pdserve sim-worker`` process on SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from unit.fake_worker import FakeWorker, WorkerScript, eventually, start_fake_worker

from pdserve.core import process
from pdserve.core.ports import free_port
from pdserve.core.types import PhaseOutput, PhaseRequest, SamplingSpec
from pdserve.router.dispatch.workers.client import UNAVAILABLE, WorkerCallError, WorkerClient
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.worker.lifecycle import WORKER_SERVICE

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
CALL_S = 30.0  # a call's own deadline: far longer than any drain below


def decode_request(request_id: str, max_tokens: int = 3) -> PhaseRequest:
    return PhaseRequest(request_id, "decode", (1, 2, 3), SamplingSpec(max_tokens=max_tokens))


async def health_of(endpoint: str) -> dict[str, int]:
    """The standard health answer for the whole server ("") and for WorkerService."""
    async with grpc.aio.insecure_channel(endpoint) as channel:
        stub: Any = health_pb2_grpc.HealthStub(channel)  # the stubs list no methods of it
        return {name: (await stub.Check(health_pb2.HealthCheckRequest(service=name),
                                        timeout=2.0)).status
                for name in ("", WORKER_SERVICE)}


async def run(client: WorkerClient, request: PhaseRequest) -> list[PhaseOutput]:
    return [out async for out in client.generate(request, CALL_S)]


@contextlib.asynccontextmanager
async def gated_decode() -> AsyncIterator[tuple[FakeWorker, asyncio.Event, WorkerClient]]:
    """A fake decode worker whose decodes wait for the gate, and a client to it."""
    gate = asyncio.Event()
    worker = await start_fake_worker("decode", WorkerScript(decode_gate=gate))
    client = WorkerClient(worker.endpoint)
    try:
        yield worker, gate, client
    finally:
        gate.set()
        await client.close()
        await worker.stop()


async def test_drain_says_not_serving_refuses_new_calls_and_finishes_those_in_flight() -> None:
    async with gated_decode() as (worker, gate, client):
        assert worker.serving is not None
        assert await health_of(worker.endpoint) == {"": SERVING, WORKER_SERVICE: SERVING}
        pool = WorkerPool(decode=[worker.endpoint])
        await pool.refresh_all()
        (seen,) = pool.decode
        assert seen.snapshot().healthy
        in_flight = asyncio.create_task(run(client, decode_request("r-old")))
        await eventually(lambda: "r-old" in worker.servicer.inflight, what="call in flight")

        drain = asyncio.create_task(worker.serving.drain(5.0))
        await eventually(lambda: worker.serving is not None and worker.serving.state.draining)
        assert await health_of(worker.endpoint) == {"": NOT_SERVING,
                                                    WORKER_SERVICE: NOT_SERVING}
        assert not (await client.health(2.0)).ready
        await pool.refresh_all()
        assert not seen.snapshot().healthy  # the router places nothing new here
        with pytest.raises(WorkerCallError) as refused:
            await run(client, decode_request("r-new"))
        assert refused.value.code == UNAVAILABLE and "draining" in refused.value.details
        assert not drain.done()  # r-old still runs

        gate.set()
        outputs = await asyncio.wait_for(in_flight, CALL_S)
        assert outputs[-1].finish_reason == "length" and len(outputs) == 3
        assert await asyncio.wait_for(drain, 3.0) is True
        assert worker.servicer.cancelled == []
        await pool.close()


async def test_drain_cancels_what_is_left_at_its_timeout() -> None:
    async with gated_decode() as (worker, _gate, client):
        assert worker.serving is not None
        in_flight = asyncio.create_task(run(client, decode_request("r-stuck")))
        await eventually(lambda: "r-stuck" in worker.servicer.inflight, what="call in flight")
        drain_s = 0.3
        started = time.monotonic()
        assert await worker.serving.drain(drain_s) is False
        elapsed = time.monotonic() - started
        # The timeout, then the stop's short grace (about 1.3 s): not less, and well
        # before the stuck call's own deadline (CALL_S) would have ended it.
        assert drain_s <= elapsed < CALL_S / 2
        with pytest.raises(WorkerCallError) as ended:
            await asyncio.wait_for(in_flight, CALL_S)
        # The drain's stop ended it (not the call's DEADLINE_EXCEEDED).
        assert ended.value.code == UNAVAILABLE, ended.value
        await eventually(lambda: worker.servicer.cancelled == ["r-stuck"],
                         what="the stuck call cancelled (so aborted) on the worker")


# ---- a real worker process on SIGTERM ------------------------------------------------


@contextlib.contextmanager
def sim_worker(*flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A ``pdserve sim-worker`` process (decode) on a free port; killed at the end."""
    port = free_port()
    proc = process.spawn(
        [sys.executable, "-m", "pdserve.cli.main", "sim-worker", "--role", "decode", "--port",
         str(port), "--log-level", "WARNING", *flags])
    try:
        yield proc, f"127.0.0.1:{port}"
    finally:
        process.stop([proc], grace_s=0, sig=signal.SIGKILL)  # a SIGSTOPped one too


async def wait_health(endpoint: str, status: int, timeout_s: float = 10.0) -> None:
    """Until the standard health service answers ``status`` for the whole server."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(grpc.aio.AioRpcError):
            if (await health_of(endpoint))[""] == status:
                return
        if time.monotonic() > deadline:
            raise AssertionError(f"{endpoint} not {status} within {timeout_s} s")
        await asyncio.sleep(0.05)


async def test_sigterm_drains_a_worker_process_and_it_exits() -> None:
    # A 6 s stream (60 tokens, 100 ms apart): the drain (NOT_SERVING, refusals) is seen
    # while it runs however slow the machine; the drain timeout and the call's deadline
    # leave it ample time to finish.
    num_tokens, stream_s = 60, 60.0
    with sim_worker("--decode-ms-per-token", "100",
                    "--drain-timeout-s", str(stream_s)) as (proc, ep):
        await wait_health(ep, SERVING)
        client = WorkerClient(ep)
        try:
            outputs = client.generate(decode_request("r-old", max_tokens=num_tokens),
                                      stream_s)
            first = await anext(outputs)
            proc.send_signal(signal.SIGTERM)
            await wait_health(ep, NOT_SERVING)
            with pytest.raises(WorkerCallError) as refused:
                await asyncio.wait_for(run(client, decode_request("r-new")), 3.0)
            assert refused.value.code == UNAVAILABLE
            rest = [out async for out in outputs]
            assert len([first, *rest]) == num_tokens and rest[-1].finish_reason == "length"
        finally:
            await client.close()
        started = time.monotonic()
        while proc.poll() is None and time.monotonic() - started < 5.0:
            await asyncio.sleep(0.05)
        assert proc.returncode == 0


async def test_keepalive_fails_a_call_to_a_hung_worker_within_seconds() -> None:
    """A worker process stopped mid-stream (SIGSTOP: the socket stays open, nothing
    answers) fails the call with UNAVAILABLE after about two keepalive intervals, long
    before the call's own deadline (60 s here)."""
    with sim_worker("--decode-ms-per-token", "50", "--grpc-keepalive-s", "1") as (proc, ep):
        await wait_health(ep, SERVING)
        client = WorkerClient(ep, keepalive_s=1.0)
        try:
            outputs = client.generate(decode_request("r-hung", max_tokens=1000), 60.0)
            await anext(outputs)
            proc.send_signal(signal.SIGSTOP)
            stopped = time.monotonic()
            with pytest.raises(WorkerCallError) as failed:
                async for _ in outputs:
                    pass
            waited = time.monotonic() - stopped
        finally:
            proc.send_signal(signal.SIGCONT)
            await client.close()
    assert failed.value.code == UNAVAILABLE  # not DEADLINE_EXCEEDED: keepalive noticed it
    # About two 1 s keepalive intervals; well under the call's 60 s deadline.
    assert waited < 30.0, f"the hung worker was noticed after {waited:.1f} s"
