"""Cluster authentication of router→worker gRPC (``pdserve/core/grpc_auth.py``): the real
``WorkerService`` servicer in front of a simulated worker, called through the router's
own client (``router/dispatch/workers/client.py``), its blocking probes and its worker pool."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import pytest_asyncio
from unit.sim_cluster import start_sim_worker

from pdserve.core.cluster_secret import ClusterSecret, num_refusals, write_cluster_secret
from pdserve.core.grpc_auth import server_interceptors
from pdserve.core.types import PhaseRequest, SamplingSpec
from pdserve.launch.up import UpConfig, plan
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient, probe_health
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.server import RouterConfig
from pdserve.worker.sim.engine import SimConfig

RIGHT = ClusterSecret(b"the-cluster-secret-0123456789")
WRONG = ClusterSecret(b"another-cluster-secret-98765")
UNAUTHENTICATED = "UNAUTHENTICATED"


@pytest_asyncio.fixture(loop_scope="function")
async def endpoint() -> AsyncIterator[str]:
    """A simulated prefill worker that requires ``RIGHT``."""
    server, port, _ = await start_sim_worker(SimConfig("prefill", "p0", block_size=16),
                                             secret=RIGHT)
    yield f"127.0.0.1:{port}"
    await server.stop(0)


async def _generate(client: WorkerClient) -> list[int]:
    request = PhaseRequest("r1", "prefill", tuple(range(40)), SamplingSpec(max_tokens=1))
    async with contextlib.aclosing(client.generate(request, timeout_s=5)) as outputs:
        return [t for out in [o async for o in outputs] for t in out.token_ids]


@pytest.mark.parametrize("secret,reason", [(None, "no token"), (WRONG, "wrong token")])
async def test_worker_refuses_a_client_without_the_token(endpoint: str,
                                                         secret: ClusterSecret | None,
                                                         reason: str) -> None:
    before = num_refusals("grpc", reason)
    client = WorkerClient(endpoint, secret)
    try:
        with pytest.raises(WorkerCallError) as unary:
            await client.health(timeout_s=5)
        assert unary.value.code == UNAUTHENTICATED and "cluster secret" in unary.value.details
        with pytest.raises(WorkerCallError, match=UNAUTHENTICATED):  # a stream too
            await _generate(client)
        with pytest.raises(WorkerCallError, match=UNAUTHENTICATED):
            await asyncio.to_thread(probe_health, endpoint, 5, secret)
    finally:
        await client.close()
    # Each of the 3 calls refused at least once (a signed one may be retried once for the
    # worker id its refusal named).
    assert num_refusals("grpc", reason) >= before + 3


async def test_worker_serves_a_client_with_the_token(endpoint: str) -> None:
    before = num_refusals("grpc")
    client = WorkerClient(endpoint, RIGHT)
    try:
        assert (await client.health(timeout_s=5)).worker_id == "p0"
        assert len(await _generate(client)) == 1
        assert (await client.kv_snapshot(timeout_s=5)).worker_id == "p0"
    finally:
        await client.close()
    health = await asyncio.to_thread(probe_health, endpoint, 5, RIGHT)
    assert health.ready
    assert num_refusals("grpc") == before


async def test_router_pool_carries_the_token(endpoint: str) -> None:
    pool = WorkerPool(prefill=[endpoint], secret=RIGHT)
    try:
        (worker,) = pool.prefill
        assert (await worker.client.health(timeout_s=5)).worker_id == "p0"
    finally:
        await pool.close()


async def test_no_secret_on_both_sides_still_works() -> None:
    server, port, _ = await start_sim_worker(SimConfig("decode", "d0", block_size=16))
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        assert (await client.health(timeout_s=5)).worker_id == "d0"
    finally:
        await client.close()
        await server.stop(0)


async def test_standard_health_service_stays_open() -> None:
    """Orchestrator probes (grpc.health.v1) cannot send the token; they only learn
    SERVING. Registered by hand here: the check is by method name."""
    server = grpc.aio.server(interceptors=server_interceptors(RIGHT))

    async def check(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return b"\x08\x01"  # HealthCheckResponse{status: SERVING}

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "grpc.health.v1.Health", {"Check": grpc.unary_unary_rpc_method_handler(check)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health_check: grpc.aio.UnaryUnaryMultiCallable[bytes, bytes] = channel.unary_unary(
                "/grpc.health.v1.Health/Check")
            reply = await health_check(b"", timeout=5)
        assert reply == b"\x08\x01"
    finally:
        await server.stop(0)


def test_bad_secret_file_is_a_one_line_error(tmp_path: Path) -> None:
    (tmp_path / "short").write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        RouterConfig(model_path="m", served_model_name="m", prefill=(), decode=("x:1",),
                     cluster_secret_file=str(tmp_path / "short"))
    with pytest.raises(ValueError, match="cannot read"):
        UpConfig(model="/m", cluster_secret_file=str(tmp_path / "missing"))


def test_up_hands_the_secret_file_to_every_child(tmp_path: Path) -> None:
    path = write_cluster_secret(tmp_path / "secret")
    children = plan(UpConfig(model="/m", cluster_secret_file=str(path)), tmp_path)
    assert {c.name for c in children} == {"prefill-0", "decode-0", "router"}
    for child in children:
        i = child.argv.index("--cluster-secret-file")
        assert child.argv[i + 1] == str(path)
        assert path.read_text().strip() not in " ".join(child.argv)  # never on a command line


async def test_closing_an_authenticated_stream_cancels_it_on_the_worker() -> None:
    """The token interceptor keeps the router's cancel: a client gone mid-decode
    frees the worker's request."""
    server, port, _ = await start_sim_worker(
        SimConfig("decode", "d0", block_size=16, decode_s_per_token=0.05), secret=RIGHT)
    client = WorkerClient(f"127.0.0.1:{port}", RIGHT)
    try:
        request = PhaseRequest("r1", "decode", tuple(range(40)), SamplingSpec(max_tokens=200))
        async with contextlib.aclosing(client.generate(request, timeout_s=30)) as outputs:
            await anext(outputs)
            assert (await client.load(timeout_s=5)).num_inflight_reqs == 1
        for _ in range(100):
            if (await client.load(timeout_s=5)).num_inflight_reqs == 0:
                break
            await asyncio.sleep(0.02)
        assert (await client.load(timeout_s=5)).num_inflight_reqs == 0
    finally:
        await client.close()
        await server.stop(0)
