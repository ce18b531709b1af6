"""etcd membership against a real etcd (Debian's etcd-server) and fake gRPC workers:
registration under a lease, list + watch into the router's pool, lease loss and
re-registration, an etcd outage (last-known set kept, health checks still drop a
dead worker, re-list on reconnect), and compatibility-aware pairing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace

import pytest
import pytest_asyncio
from pdserve_testing import etcd_keys
from prometheus_client import CollectorRegistry
from unit.fake_worker import FakeWorker, WorkerScript, eventually, start_fake_worker

from pdserve.core.types import Role
from pdserve.membership import MembershipConfig, WorkerInfo, create_membership
from pdserve.membership.etcd import EtcdMembership
from pdserve.membership.etcd_registrar import EtcdRegistrar
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.membership.static import load_workers_file
from pdserve.router.dispatch.policies.placement import (
    LeastLoadedPlacement,
    Placement,
    RoundRobinPlacement,
)
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import WorkerState

CLUSTER = "unit"
TTL_S = 2
# How long a change registered in etcd may take to reach the view. The router never
# re-lists on a timer (only on reconnect), so a change shows through the watch or not
# at all, and any bound proves the watch delivered it: generous, for loaded machines.
SETTLE_S = 10.0
REVOKE_TTL_S = 60  # s, far longer than SETTLE_S


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


def info_of(worker: FakeWorker, role: str, compat: str = "compat-a") -> WorkerInfo:
    """The registration a fake worker would write (its Health id, its endpoint)."""
    return WorkerInfo(worker_id=f"fake-{role}-{id(worker.servicer):x}", role=role,
                      grpc_endpoint=worker.endpoint, compatibility_hash=compat,
                      kv_endpoints={"tcp": "127.0.0.1:1"}, model="fake", dtype="float32",
                      block_size=128, max_model_len=4096)


class View:
    """A router's pool fed by etcd membership, with its listener calls recorded."""

    def __init__(self, url: str, cluster: str) -> None:
        self.registry = CollectorRegistry()
        self.membership = EtcdMembership(url, cluster, registry=self.registry,
                                         probe_interval_s=0.2, retry_s=0.2)
        self.pool = WorkerPool(interval_s=0.5)
        self.added: list[str] = []
        self.removed: list[str] = []
        self.pool.on_worker_added(lambda s: self.added.append(s.worker_id))
        self.pool.on_worker_removed(lambda s: self.removed.append(s.worker_id))

    def healthy_ids(self) -> set[str]:
        return {w.snapshot().worker_id for w in self.pool.all if w.snapshot().healthy}

    def ids(self) -> set[str]:
        return {w.snapshot().worker_id for w in self.pool.all}

    def metric(self, name: str) -> float | None:
        return self.registry.get_sample_value(name)


@pytest_asyncio.fixture(loop_scope="function")
async def view(etcd: LocalEtcd, request: pytest.FixtureRequest) -> AsyncIterator[View]:
    v = View(etcd.url, f"{CLUSTER}-{request.node.name.replace('_', '-')}")
    await v.pool.start(v.membership)
    try:
        yield v
    finally:
        await v.pool.close()


def test_worker_info_json_round_trip_and_bad_input() -> None:
    info = WorkerInfo(worker_id="p-1", role="prefill", grpc_endpoint="10.0.0.1:50051",
                      kv_endpoints={"tcp": "10.0.0.1:51051"}, compatibility_hash="abc",
                      capacity={"kv_cache_gib": 1})
    assert WorkerInfo.from_json(info.to_json()) == info
    with pytest.raises(ValueError, match="lacks"):
        WorkerInfo.from_json(json.dumps({"role": "decode"}))
    with pytest.raises(ValueError, match="role must be one of"):
        WorkerInfo(worker_id="x", role="both", grpc_endpoint="h:1")
    with pytest.raises(ValueError, match="host:port"):
        WorkerInfo(worker_id="x", role="decode", grpc_endpoint="nohost")
    with pytest.raises(ValueError, match="worker id"):
        WorkerInfo(worker_id="a/b", role="decode", grpc_endpoint="h:1")
    with pytest.raises(ValueError, match="valid: static, etcd"):
        MembershipConfig(kind="zookeeper")
    with pytest.raises(ValueError, match="http://HOST:PORT or https://HOST:PORT"):
        MembershipConfig.from_flags("etcd://x:1", "c", 10)
    with pytest.raises(ValueError, match="not both"):
        MembershipConfig.from_flags("http://x:1", "c", 10, prefill=("a:1",))


def test_workers_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "workers.json"
    path.write_text(json.dumps({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]}))
    assert load_workers_file(path) == (["127.0.0.1:1"], ["127.0.0.1:2"])
    path.write_text(json.dumps({"decoders": []}))
    with pytest.raises(ValueError, match="keys prefill, decode"):
        load_workers_file(path)
    cfg = MembershipConfig.from_flags(None, "c", 10, workers_file=str(path.with_name("no")))
    with pytest.raises(ValueError, match="cannot read workers file"):
        create_membership(cfg)


async def test_registered_worker_is_routable_at_once_and_leaves_on_revoke(
        etcd: LocalEtcd, view: View) -> None:
    worker = await start_fake_worker("decode")
    # A lease far longer than the wait for its revoke below: only the revoke, not the
    # lease's expiry, can remove the worker in time.
    registrar = EtcdRegistrar(etcd.url, str(view.membership.describe()["cluster"]),
                              ttl_s=REVOKE_TTL_S)
    info = info_of(worker, "decode")
    try:
        await registrar.start(info)  # an fsync'ed put: slow on a loaded disk
        await eventually(lambda: info.worker_id in view.healthy_ids(), SETTLE_S, "routable")
        assert view.added == [info.worker_id]
        assert view.metric("pdserve:membership_etcd_up") == 1
        await registrar.close()  # a clean shutdown revokes the lease: gone at once
        await eventually(lambda: not view.ids(), SETTLE_S, "removed after revoke")
        assert view.removed == [info.worker_id]
    finally:
        await registrar.close()
        await worker.stop()


async def test_lost_lease_leaves_the_view_then_registers_again(
        etcd: LocalEtcd, view: View) -> None:
    worker = await start_fake_worker("prefill")
    registrar = EtcdRegistrar(etcd.url, str(view.membership.describe()["cluster"]),
                              ttl_s=TTL_S)
    info = info_of(worker, "prefill")
    try:
        await registrar.start(info)
        await eventually(lambda: info.worker_id in view.healthy_ids(), SETTLE_S, "routable")
        first_lease = registrar.lease_id
        # A paused process: no keepalive. The lease expires and the router drops it.
        assert registrar._task is not None
        registrar._task.cancel()
        await asyncio.gather(registrar._task, return_exceptions=True)
        # Expiry is the only way it can go (no revoke, no re-list): any bound will do.
        await eventually(lambda: not view.ids(), TTL_S + SETTLE_S, "removed on lease expiry")
        # Resumed: the next keepalive finds the lease gone and registers anew.
        await registrar._tick()
        assert registrar.lease_id not in (None, first_lease)
        assert registrar.num_registrations == 2
        await eventually(lambda: info.worker_id in view.healthy_ids(), SETTLE_S, "back")
    finally:
        await registrar.close()
        await worker.stop()


async def test_etcd_outage_keeps_last_known_set_then_relists(etcd: LocalEtcd,
                                                             view: View) -> None:
    cluster = str(view.membership.describe()["cluster"])
    a, b, late = [await start_fake_worker("decode") for _ in range(3)]
    regs = [EtcdRegistrar(etcd.url, cluster, ttl_s=TTL_S) for _ in range(3)]
    infos = [info_of(w, "decode") for w in (a, b, late)]
    try:
        await regs[0].start(infos[0])
        await regs[1].start(infos[1])
        await eventually(lambda: view.healthy_ids() == {infos[0].worker_id,
                                                        infos[1].worker_id}, SETTLE_S,
                         "both")
        await asyncio.to_thread(etcd.stop, keep_data=True)
        await eventually(lambda: not view.membership.connected, SETTLE_S, "outage seen")
        assert view.metric("pdserve:membership_etcd_up") == 0
        await asyncio.sleep(TTL_S + 1)  # past the TTL: nothing expires while etcd is down
        assert view.ids() == {infos[0].worker_id, infos[1].worker_id}
        await b.stop()  # etcd still lists b, but b fails the router's health checks
        await eventually(lambda: view.healthy_ids() == {infos[0].worker_id}, SETTLE_S,
                         "b dropped")
        await asyncio.to_thread(etcd.start)  # the fake workers share this event loop
        await regs[2].start(infos[2])  # a worker that joins after the restart
        await eventually(lambda: infos[2].worker_id in view.healthy_ids(), SETTLE_S,
                         "discovered")
        assert view.membership.connected
        assert view.metric("pdserve:membership_etcd_reconnects_total") == 1
        assert infos[0].worker_id in view.healthy_ids()
    finally:
        for reg in regs:
            await reg.close()
        for w in (a, b, late):
            await w.stop()


async def test_only_compatible_pairs_are_chosen(etcd: LocalEtcd, view: View) -> None:
    cluster = str(view.membership.describe()["cluster"])
    roles: list[tuple[Role, str]] = [
        ("prefill", "compat-a"), ("prefill", "compat-b"), ("decode", "compat-a"),
        ("decode", "compat-b"), ("decode", "compat-c")]
    workers = [await start_fake_worker(role, WorkerScript(compatibility_hash=compat))
               for role, compat in roles]
    regs = [EtcdRegistrar(etcd.url, cluster, ttl_s=TTL_S) for _ in roles]
    try:
        for reg, worker, (role, compat) in zip(regs, workers, roles, strict=True):
            await reg.start(info_of(worker, role, compat))
        await eventually(lambda: len(view.healthy_ids()) == 5, SETTLE_S, "all five")
        pairs: set[tuple[str, str]] = set()
        for policy in (RoundRobinPlacement(), LeastLoadedPlacement()):
            for cursor in range(30):
                pairs.add(choose(policy, view.pool, cursor))
        assert pairs == {("compat-a", "compat-a"), ("compat-b", "compat-b"),
                         ("none", "compat-c")}  # c has no prefill: decode alone
    finally:
        for reg in regs:
            await reg.close()
        for w in workers:
            await w.stop()


def choose(policy: Placement, pool: WorkerPool, cursor: int) -> tuple[str, str]:
    prefill: list[WorkerState] = [w.snapshot() for w in pool.prefill]
    decode: list[WorkerState] = [w.snapshot() for w in pool.decode]
    choice = policy.choose(prefill, decode, cursor)
    assert choice is not None
    p = prefill[choice.prefill].compatibility_hash if choice.prefill is not None else "none"
    return p, decode[choice.decode].compatibility_hash


async def test_a_role_switch_moves_the_key_and_the_view_follows(
        etcd: LocalEtcd, view: View) -> None:
    """The worker's re-announcement (``Registrar.update``) after ``SetRole``: its key
    moves to the new role's prefix at once (the old lease is revoked), and a router fed
    by etcd files it under the new role, once."""
    worker = await start_fake_worker("decode")
    cluster = str(view.membership.describe()["cluster"])
    registrar = EtcdRegistrar(etcd.url, cluster, ttl_s=REVOKE_TTL_S)
    info = info_of(worker, "decode")
    assert worker.serving is not None

    async def reannounce() -> None:
        await registrar.update(replace(info, role=worker.servicer.health().role))

    worker.serving.state.on_role_changed = reannounce
    try:
        await registrar.start(info)
        await eventually(lambda: info.worker_id in view.healthy_ids(), SETTLE_S, "routable")
        result = await worker.serving.state.switch_role("prefill", 1.0)
        assert result.changed
        prefix = f"/pdserve/{cluster}/workers/"
        assert list(etcd_keys(etcd.url, prefix)) == [f"{prefix}prefill/{info.worker_id}"]
        await eventually(lambda: [w.snapshot().worker_id for w in view.pool.prefill
                                  if w.snapshot().healthy] == [info.worker_id]
                         and not view.pool.decode, SETTLE_S, "filed under prefill")
    finally:
        await registrar.close()
        await worker.stop()
