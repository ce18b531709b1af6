"""The planner's leader election (``pdserve.membership.election``): the etcd
implementation against a real etcd (one leader among candidates; a clean stop hands
over at once, a dead leader once its TTL has run out and never two leaders at once; a leader
whose lease is lost stops leading), the static one, and planner loops that decide only
in the leader."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import pytest_asyncio
from pdserve_testing import etcd_keys
from prometheus_client import CollectorRegistry
from unit.fake_worker import eventually
from unit.fakes import ROUTER_MODEL, Clock, asgi_http_client

from pdserve.membership import MembershipConfig, create_election, leader_key
from pdserve.membership.election import StaticElection
from pdserve.membership.etcd import etcd_client
from pdserve.membership.etcd_election import EtcdElection
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.router.cluster.planner_loop import PlannerLoop
from pdserve.router.dispatch.policies.demand import DemandWindow
from pdserve.router.dispatch.policies.planner import Demand, PlannerConfig, PlannerInputs, Split
from pdserve.router.dispatch.policies.slo import SloConfig
from pdserve.router.dispatch.workers.pool import WorkerPool
from pdserve.router.dispatch.workers.state import StepCost
from pdserve.router.server import Router, RouterConfig, build_router

TTL_S = 2
LONG_TTL_S = 30  # far longer than SETTLE_S: only a revoke can end such a lease in time
SETTLE_S = 10.0  # a change through etcd's watch, on a loaded machine
CONFIG = PlannerConfig(mode="on", interval_s=5, window_s=30, hold_s=0, cooldown_s=0)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        yield server


@pytest_asyncio.fixture(loop_scope="function")
async def candidates(etcd: LocalEtcd, request: pytest.FixtureRequest
                     ) -> AsyncIterator[Callable[[int], list[EtcdElection]]]:
    """``make(ttl_s)``: two started candidates of a cluster of this test's own."""
    cluster = "election-" + request.node.name.replace("_", "-")
    made: list[EtcdElection] = []

    async def make(ttl_s: int) -> list[EtcdElection]:
        pair = [EtcdElection(etcd.url, cluster, f"router-{i}", ttl_s, retry_s=0.1)
                for i in range(2)]
        made.extend(pair)
        for election in pair:
            await election.start()
        return pair

    try:
        yield make  # type: ignore[misc]
    finally:
        for election in made:
            await election.close()


def leaders(elections: list[EtcdElection]) -> list[EtcdElection]:
    return [e for e in elections if e.is_leader]


async def watch_overlap(elections: list[EtcdElection], stop: asyncio.Event) -> int:
    """Samples the candidates every 10 ms until ``stop``; returns how often two led."""
    overlaps = 0
    while not stop.is_set():
        overlaps += len(leaders(elections)) > 1
        await asyncio.sleep(0.01)
    return overlaps


def test_static_election_leads_iff_a_candidate() -> None:
    assert StaticElection(True).is_leader and not StaticElection(False).is_leader
    static = MembershipConfig()
    on_etcd = MembershipConfig("etcd", etcd_url="http://127.0.0.1:2379", cluster="c")
    assert create_election(static, True, "r").is_leader
    assert not create_election(static, False, "r").is_leader
    assert not create_election(on_etcd, False, "r").is_leader  # not a candidate
    assert isinstance(create_election(on_etcd, True, "r"), EtcdElection)
    assert leader_key("c") == "/pdserve/c/planner/leader"
    with pytest.raises(ValueError, match=">= 2"):
        EtcdElection("http://127.0.0.1:2379", "c", "r", ttl_s=1)


async def test_one_leader_among_two_candidates(etcd: LocalEtcd, candidates: Any) -> None:
    pair = await candidates(LONG_TTL_S)
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader")
    (leader,) = leaders(pair)
    other = next(e for e in pair if e is not leader)
    await eventually(lambda: other.leader_id == leader.candidate_id, SETTLE_S, "known")
    assert etcd_keys(etcd.url, leader.key) == {leader.key: leader.candidate_id.encode()}
    assert leader.describe()["leader"] is True and other.describe()["leader"] is False
    assert (leader.num_terms, other.num_terms) == (1, 0)


async def test_a_stopped_leader_hands_over_at_once(etcd: LocalEtcd, candidates: Any) -> None:
    pair = await candidates(LONG_TTL_S)
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader")
    (leader,) = leaders(pair)
    other = next(e for e in pair if e is not leader)
    await leader.close()  # revokes its lease: the key goes at once
    assert not leader.is_leader
    # Gone by the time close returns: the revoke, not the expiry of a 30 s lease.
    held = etcd_keys(etcd.url, leader.key).get(leader.key)
    assert held != leader.candidate_id.encode(), held
    await eventually(lambda: other.is_leader, SETTLE_S, "the survivor leads")


async def test_a_dead_leader_hands_over_once_its_ttl_runs_out_never_two_at_once(
        candidates: Any) -> None:
    pair = await candidates(TTL_S)
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader")
    (leader,) = leaders(pair)
    other = next(e for e in pair if e is not leader)
    stop = asyncio.Event()
    overlap = asyncio.ensure_future(watch_overlap(pair, stop))
    # Dead (or paused, or cut off from etcd): no keepalive, no revoke, no watch.
    assert leader._task is not None
    leader._task.cancel()
    await asyncio.gather(leader._task, return_exceptions=True)
    # It stops leading by itself, from its own clock, one TTL after its last keepalive;
    # the survivor leads once etcd expires the lease (never both: ``overlap``). SETTLE_S
    # of slack for etcd's expiry check, the watch and transaction on a loaded machine.
    await eventually(lambda: not leader.is_leader, TTL_S + SETTLE_S, "the dead leader stops")
    await eventually(lambda: other.is_leader, TTL_S + SETTLE_S, "the survivor leads")
    stop.set()
    assert await overlap == 0


async def test_a_leader_whose_lease_is_lost_stops_leading_then_campaigns_again(
        etcd: LocalEtcd, candidates: Any) -> None:
    pair = await candidates(LONG_TTL_S)
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader")
    (leader,) = leaders(pair)
    first_lease = leader.lease_id
    assert first_lease is not None
    client = etcd_client(etcd.url)
    try:
        await client.revoke_lease(first_lease)  # etcd lost it (an operator, a restore)
    finally:
        await client.close()
    # The old term ends as soon as its watch sees the key go (the survivor learns it
    # from its own watch: the two may overlap for that delivery, unlike an expiry,
    # which the leader's own clock anticipates); a new term starts, in this candidate
    # (a new lease, its second term) or in the other.
    await eventually(lambda: leader.num_terms == 2 or not leader.is_leader, SETTLE_S,
                     "the old term ends")
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader again")
    if leader.is_leader:
        assert leader.lease_id != first_lease and leader.num_terms == 2


# ---- planner loops driven by elections ------------------------------------------------

class RecordingSwitcher:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    async def switch(self, worker_id: str, role: str, drain_timeout_s: float) -> None:
        self.calls.append((worker_id, role))


def stub_worker(worker_id: str, role: str) -> Any:
    snapshot = SimpleNamespace(healthy=True, worker_id=worker_id, num_assigned=0,
                               num_assigned_tokens=0)
    return SimpleNamespace(role=role, snapshot=lambda: snapshot)


def loaded_loop(config: PlannerConfig, election: Any = None) -> tuple[PlannerLoop,
                                                                      RecordingSwitcher,
                                                                      CollectorRegistry]:
    """A loop over one prefill and two decode workers whose measured load asks for no
    prefill worker at all (short prompts only): every decision moves one."""
    pool: Any = SimpleNamespace(prefill=[stub_worker("p0", "prefill")],
                                decode=[stub_worker("d0", "decode"), stub_worker("d1", "decode")])
    pool.all = pool.prefill + pool.decode
    switcher, registry, clock = RecordingSwitcher(), CollectorRegistry(), Clock()
    loop = PlannerLoop(config, pool, switcher, DemandWindow(config.window_s, clock),  # type: ignore[arg-type]
                       SloConfig(itl_s=0.2), registry, clock, election)
    short_heavy = Demand(long_tokens_per_s=0, short_tokens_per_s=160, output_tokens_per_s=190)
    cost = StepCost(0.040, 0.001, 0.001, True, True)
    loop.inputs = lambda: PlannerInputs(Split(1, 2), short_heavy, cost, 0.2)  # type: ignore[method-assign]
    return loop, switcher, registry


def desired(registry: CollectorRegistry, role: str) -> float | None:
    return registry.get_sample_value("pdserve:planner_desired_replicas", {"role": role})


async def test_static_loops_decide_iff_on_and_export_mode_switches_nothing() -> None:
    on, on_switcher, on_registry = loaded_loop(CONFIG)
    assert on_registry.get_sample_value("pdserve:planner_leader") == 0  # before a decision
    decision = await on.step()
    assert decision is not None and decision.move == "to_decode"
    assert on_switcher.calls == [("p0", "decode")]
    assert on_registry.get_sample_value("pdserve:planner_leader") == 1
    assert (desired(on_registry, "prefill"), desired(on_registry, "decode")) == (0, 3)

    export, export_switcher, export_registry = loaded_loop(
        PlannerConfig(mode="export", hold_s=0, cooldown_s=0))
    decision = await export.step()
    assert decision is not None and decision.move == "to_decode"
    assert not export_switcher.calls  # an autoscaler acts on what it exports
    assert desired(export_registry, "decode") == 3

    off, off_switcher, off_registry = loaded_loop(PlannerConfig(mode="off"))
    assert await off.step() is None and not off_switcher.calls
    assert off_registry.get_sample_value("pdserve:planner_leader") == 0


async def test_two_planner_loops_decide_only_in_the_leader(candidates: Any) -> None:
    pair = await candidates(LONG_TTL_S)
    loops = [loaded_loop(CONFIG, election) for election in pair]
    await eventually(lambda: len(leaders(pair)) == 1, SETTLE_S, "one leader")
    first = next(i for i, e in enumerate(pair) if e.is_leader)
    for _ in range(3):
        decisions = [await loop.step() for loop, _, _ in loops]
        assert decisions[first] is not None and decisions[1 - first] is None
    calls = [len(switcher.calls) for _, switcher, _ in loops]
    assert calls[first] == 3 and calls[1 - first] == 0
    gauges = [r.get_sample_value("pdserve:planner_leader") for _, _, r in loops]
    assert gauges[first] == 1 and gauges[1 - first] == 0
    assert desired(loops[1 - first][2], "decode") == 0  # never decided: nothing exported

    await pair[first].close()  # a clean stop: the other replica's planner takes over
    await eventually(lambda: pair[1 - first].is_leader, SETTLE_S, "handover")
    decisions = [await loop.step() for loop, _, _ in loops]
    assert decisions[first] is None and decisions[1 - first] is not None
    gauges = [r.get_sample_value("pdserve:planner_leader") for _, _, r in loops]
    assert gauges[first] == 0 and gauges[1 - first] == 1
    assert len(loops[1 - first][1].calls) == 1


async def test_a_router_with_etcd_membership_campaigns_only_with_the_planner_on(
        etcd: LocalEtcd) -> None:
    pool = WorkerPool()
    config = MembershipConfig("etcd", etcd_url=etcd.url, cluster="election-router", ttl_s=TTL_S)
    election = create_election(config, True, "router-a")
    loop = PlannerLoop(CONFIG, pool, RecordingSwitcher(), DemandWindow(30.0),  # type: ignore[arg-type]
                       election=election)
    await election.start()
    try:
        await eventually(lambda: election.is_leader, SETTLE_S, "the only candidate leads")
        decision = await loop.step()
        assert decision is not None and decision.reason == "no step measured yet"
    finally:
        await election.close()
        await pool.close()
    assert not create_election(config, False, "router-b").is_leader


async def test_two_routers_on_etcd_elect_one_planner_and_say_which(etcd: LocalEtcd,
                                                                   tokenizer: Any) -> None:
    """``build_router`` as ``pdserve router --etcd URL --planner on`` wires it, twice:
    one replica leads (``/workers``' ``planner``), and a clean close hands over."""
    membership = MembershipConfig("etcd", etcd_url=etcd.url, cluster="election-routers",
                                  ttl_s=LONG_TTL_S)
    routers: list[Router] = []
    for port in (18001, 18002):
        router = build_router(RouterConfig(
            model_path="unused", served_model_name=ROUTER_MODEL, prefill=(), decode=(),
            port=port, membership=membership, planner=PlannerConfig(mode="on")), tokenizer)
        await router.start()
        routers.append(router)
    try:
        elections = [r.election for r in routers]
        await eventually(lambda: sum(e.is_leader for e in elections) == 1, SETTLE_S, "one")
        first = next(i for i, e in enumerate(elections) if e.is_leader)
        views = []
        for router in routers:
            async with asgi_http_client(router.app) as http:
                views.append((await http.get("/workers")).json()["planner"])
        assert [v["leader"] for v in views] == [i == first for i in range(2)]
        assert views[first]["leader_id"] == elections[first].candidate_id
        assert f":{18001 + first}:" in elections[first].candidate_id
        await routers[first].close()
        await eventually(lambda: elections[1 - first].is_leader, SETTLE_S, "handover")
    finally:
        for router in routers:
            await router.close()


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_planner_plans_for_its_share_of_the_demand_times_the_scale(scale: float) -> None:
    """A router that sees 1/scale of the requests (one of ``--processes`` 4, or of 4
    replicas) plans for its demand and its in-flight batch times the scale."""
    cost = StepCost(0.040, 0.001, 0.001, True, True)
    snapshot = SimpleNamespace(healthy=True, worker_id="w", num_assigned=0,
                               num_assigned_tokens=0, prefill_chunk_tokens=256,
                               load=SimpleNamespace(step=cost))
    pool: Any = SimpleNamespace(all=[SimpleNamespace(role=r, snapshot=lambda: snapshot)
                                     for r in ("prefill", "decode")])
    clock = Clock()
    config = PlannerConfig(mode="on", window_s=10.0, demand_scale=scale)
    window = DemandWindow(config.window_s, clock)
    loop = PlannerLoop(config, pool, RecordingSwitcher(), window,  # type: ignore[arg-type]
                       SloConfig(itl_s=0.2), CollectorRegistry(), clock)
    clock.now += 10.0
    for _ in range(5):
        window.on_arrival(100)
    window.on_finished(50)
    demand = loop.inputs().demand
    seen = window.demand(lambda n: False)
    assert demand.short_tokens_per_s == pytest.approx(scale * seen.short_tokens_per_s)
    assert demand.output_tokens_per_s == pytest.approx(scale * seen.output_tokens_per_s)
    assert demand.short_tokens_per_s > 0
