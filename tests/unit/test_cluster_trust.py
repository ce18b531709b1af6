"""Only the cluster joins (issue 40, "Must show"): simulated workers over real gRPC, a
real etcd (``LocalEtcd``) and the router's own pool, membership and dispatcher.

- A rogue worker (a gRPC server that serves anyone) registered in etcd without the
  cluster secret, or with another secret's MAC, is never placed on: the router sends
  it not one call, while real workers serve every request.
- A real router header captured from a real call fails UNAUTHENTICATED when replayed,
  to the same worker (its nonce is spent) and to another worker (another audience).
- A worker that cannot prove the secret (served without it, listed statically) gets
  its health probes refused by the router and no request.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest
import pytest_asyncio
from prometheus_client import CollectorRegistry
from unit.fake_worker import eventually

from pdserve.core.cluster_secret import ClusterSecret, num_refusals
from pdserve.core.grpc_auth import CallAuth
from pdserve.core.types import PhaseOutput, PhaseRequest, Role, SamplingSpec
from pdserve.launch.sim_worker import sim_host, sim_role_policy, sim_worker_info
from pdserve.membership import WorkerInfo, worker_key
from pdserve.membership.etcd import EtcdMembership
from pdserve.membership.etcd_client import etcd_client
from pdserve.membership.etcd_registrar import EtcdRegistrar
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.membership.signed import signed_value
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import RoundRobinPlacement
from pdserve.router.dispatch.workers import session as session_module
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.worker.host import EngineHost
from pdserve.worker.servicer import ServingState, WorkerServicer, start_worker_server
from pdserve.worker.sim.engine import SimConfig, SimEngine

SECRET = ClusterSecret(b"the-cluster-secret-0123456789")
OTHER = ClusterSecret(b"a-stranger-secret-9876543210")
SETTLE_S = 10.0
NUM_REQUESTS = 8


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


class CallCounter(grpc.aio.ServerInterceptor):
    """Counts every call a server receives, by method."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails],
                                     Awaitable[grpc.RpcMethodHandler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        self.calls.append(handler_call_details.method)
        return await continuation(handler_call_details)


@dataclass
class Worker:
    host: EngineHost
    server: grpc.aio.Server
    port: int
    counter: CallCounter = field(default_factory=CallCounter)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def info(self) -> WorkerInfo:
        return sim_worker_info(self.host, "127.0.0.1", self.port)


async def start_worker(role: Role, worker_id: str, secret: ClusterSecret | None) -> Worker:
    host = sim_host(SimConfig(role, worker_id, block_size=16))
    served = await start_worker_server(host, secret=secret)
    return Worker(host, served.server, served.port)


class CountingHost(EngineHost):
    """A simulated worker that records every request it is given to run."""

    def __init__(self, config: SimConfig) -> None:
        super().__init__(config.engine_config, config.worker_id, sim_role_policy(config.role),
                         lambda _, counters: SimEngine(config, counters))
        self.started: list[str] = []
        self.start()

    def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        self.started.append(request.request_id)
        return super().generate(request)


async def start_rogue(worker_id: str) -> Worker:
    """A decode worker that serves anyone (no secret) and counts what it receives."""
    counter = CallCounter()
    host = CountingHost(SimConfig("decode", worker_id, block_size=16))
    server = grpc.aio.server(interceptors=[counter])
    state = ServingState(host)
    pb_grpc.add_WorkerServiceServicer_to_server(WorkerServicer(host, state), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await state.update()
    await server.start()
    return Worker(host, server, port, counter)


@dataclass
class Router:
    pool: WorkerPool
    dispatcher: PDDispatcher

    def healthy(self) -> set[str]:
        return {w.snapshot().worker_id for w in self.pool.all if w.snapshot().healthy}

    async def serve(self, n: int) -> None:
        spec = SamplingSpec(max_tokens=3)
        for i in range(n):
            chunks = self.dispatcher.generate(f"r{i}", tuple(range(10 + i, 50 + i)), spec)
            async with contextlib.aclosing(chunks):
                got = [c async for c in chunks]
            assert got, f"request r{i} got no output"


@contextlib.asynccontextmanager
async def router(membership: Any, prefill: tuple[str, ...] = (),
                 decode: tuple[str, ...] = ()) -> AsyncIterator[Router]:
    pool = WorkerPool(list(prefill), list(decode), interval_s=0.3, secret=SECRET)
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), CollectorRegistry(),
                              request_timeout_s=10.0, disagg=DisaggConfig(mode="always"))
    if membership is not None:
        await pool.start(membership)
    try:
        yield Router(pool, dispatcher)
    finally:
        await pool.close()


@pytest_asyncio.fixture(loop_scope="function")
async def workers() -> AsyncIterator[dict[str, Worker]]:
    started = {"p0": await start_worker("prefill", "p0", SECRET),
               "d0": await start_worker("decode", "d0", SECRET),
               "d1": await start_worker("decode", "d1", SECRET),
               "rogue": await start_rogue("rogue")}
    yield started
    await asyncio.gather(*(w.server.stop(0) for w in started.values()))


async def test_rogue_entries_in_etcd_are_never_placed_on(etcd: LocalEtcd,
                                                         workers: dict[str, Worker]) -> None:
    cluster = "trust-rogue"
    registrars = [EtcdRegistrar(etcd.url, cluster, ttl_s=10, secret=SECRET) for _ in range(2)]
    await registrars[0].start(workers["p0"].info())
    await registrars[1].start(workers["d0"].info())
    rogue = workers["rogue"].info()
    # One rogue entry without any MAC, one MACed with another secret (same worker, two ids).
    unsigned = WorkerInfo(**{**rogue.__dict__, "worker_id": "rogue-unsigned"})
    forged = WorkerInfo(**{**rogue.__dict__, "worker_id": "rogue-forged"})
    writer = etcd_client(etcd.url)
    for info, value in ((unsigned, unsigned.to_json()),
                        (forged, signed_value(OTHER, worker_key(cluster, "decode",
                                                                "rogue-forged"), forged))):
        await writer.put(worker_key(cluster, "decode", info.worker_id).encode(), value)
    before = {r: num_refusals("membership", r) for r in ("entry without MAC", "entry MAC wrong")}
    membership = EtcdMembership(etcd.url, cluster, registry=CollectorRegistry(),
                                probe_interval_s=0.2, retry_s=0.2, secret=SECRET)
    try:
        async with router(membership) as r:
            await eventually(lambda: r.healthy() == {"p0", "d0"}, SETTLE_S, "real workers")
            await r.serve(NUM_REQUESTS)
            # One more rogue entry written while the router watches: ignored too.
            late = WorkerInfo(**{**rogue.__dict__, "worker_id": "rogue-late"})
            await writer.put(worker_key(cluster, "decode", "rogue-late").encode(),
                             late.to_json())
            await eventually(lambda: num_refusals("membership", "entry without MAC")
                             >= before["entry without MAC"] + 2, SETTLE_S, "late refusal")
            await r.serve(NUM_REQUESTS)
            assert {w.snapshot().worker_id for w in r.pool.all} == {"p0", "d0"}
        assert num_refusals("membership", "entry MAC wrong") >= before["entry MAC wrong"] + 1
        assert workers["rogue"].counter.calls == []  # not one call, not even Health
        engine = cast(SimEngine, workers["p0"].host.engine)  # sim_host's
        assert engine.counters.prompt_tokens_computed > 0
    finally:
        for registrar in registrars:
            await registrar.close()
        await writer.delete_prefix(f"/pdserve/{cluster}/".encode())
        await writer.close()


async def test_a_worker_without_the_secret_is_never_placed_on(
        workers: dict[str, Worker]) -> None:
    """The second line: listed statically (no etcd MAC to check), the rogue answers but
    cannot prove the secret, so the router never counts it healthy nor sends it work."""
    before = num_refusals("grpc", "no worker proof")
    w = workers
    async with router(None, (w["p0"].endpoint,),
                      (w["d0"].endpoint, w["rogue"].endpoint)) as r:
        await r.pool.refresh_all()
        await eventually(lambda: "d0" in r.healthy(), SETTLE_S, "d0 healthy")
        await r.serve(NUM_REQUESTS)
        assert "rogue" not in r.healthy()
    assert num_refusals("grpc", "no worker proof") > before
    placed = {m.rsplit("/", 1)[1] for m in w["rogue"].counter.calls}
    assert placed and placed <= {"Health", "GetLoad"}  # probed, refused, never given work


async def test_a_captured_header_replayed_fails(workers: dict[str, Worker],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    captured: list[tuple[tuple[str, str], ...]] = []
    sign = CallAuth.sign

    def capture(self: CallAuth, method: str) -> tuple[tuple[tuple[str, str], ...], str]:
        md, nonce = sign(self, method)
        if method.endswith("/Health") and self.audience == "d0":
            captured.append(md)
        return md, nonce

    monkeypatch.setattr(CallAuth, "sign", capture)
    async with router(None, (workers["p0"].endpoint,), (workers["d0"].endpoint,)) as r:
        await r.pool.refresh_all()
        await eventually(lambda: r.healthy() == {"p0", "d0"}, SETTLE_S, "healthy")
    assert captured, "no Health call to d0 was signed"
    header = captured[0]  # its call succeeded: the pool counted d0 healthy
    replays = {"replayed nonce": workers["d0"], "wrong token": workers["d1"]}
    before = {reason: num_refusals("grpc", reason) for reason in replays}
    for reason, target in replays.items():
        async with grpc.aio.insecure_channel(target.endpoint) as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.Health(pb.HealthRequest(), metadata=header, timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED, reason
            with pytest.raises(grpc.aio.AioRpcError) as other_method:
                await stub.GetLoad(pb.GetLoadRequest(), metadata=header, timeout=5)
            assert other_method.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert num_refusals("grpc", reason) > before[reason]


async def test_a_session_sends_no_prompt_before_the_worker_proved_the_secret(
        workers: dict[str, Worker], monkeypatch: pytest.MonkeyPatch) -> None:
    """Straight to the rogue's Session, its id known (as from membership): the call opens,
    the rogue cannot prove the secret, and the request fails UNAUTHENTICATED without the
    rogue ever being given it."""
    rogue = workers["rogue"]
    assert isinstance(rogue.host, CountingHost)
    # A server that answers nothing before its first message (as grpc does by default)
    # fails the wait for its proof, not the request's deadline.
    monkeypatch.setattr(session_module, "PROOF_TIMEOUT_S", 0.5)
    before = num_refusals("grpc", "no worker proof")
    client = WorkerClient(rogue.endpoint, SECRET, worker_id="rogue")
    request = PhaseRequest("secret-prompt", "decode", tuple(range(40)),
                           SamplingSpec(max_tokens=2))
    try:
        with pytest.raises(WorkerCallError) as refused:
            async with contextlib.aclosing(client.generate(request, timeout_s=5)) as outputs:
                [o async for o in outputs]
        assert refused.value.code == "UNAUTHENTICATED"
    finally:
        await client.close()
    assert any(m.endswith("/Session") for m in rogue.counter.calls)  # it was dialled
    assert rogue.host.started == []  # and given nothing
    assert num_refusals("grpc", "no worker proof") == before + 1
