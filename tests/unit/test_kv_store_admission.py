"""The cluster KV store's admission (``--kv-store-admission``) through the tiers' own policy
interface (no Redis, no vLLM): the doorkeeper refuses a block wanted once and admits it
at its second want; a refused block stops the rest of its request's run (what is
written stays a prefix); a lookup's hit counts as a want; the count of blocks kept out
reaches GetLoad and ``/metrics``; the flag parses on workers and ``up``; ``cache-sim
--admission`` replays the same policy in front of a tier."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
from unit.connector_fakes import FakeRequest

from pdserve.bench.micro.cache_sim.replay import replay
from pdserve.bench.micro.cache_sim.trace import Trace, block_key
from pdserve.bench.micro.configs import CacheSimConfig
from pdserve.cli.configs import connector_config, up_config
from pdserve.cli.main import main
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.core.types import WorkerHealth, WorkerLoadReport
from pdserve.kv_transfer.metadata import PdserveConnectorMetadata
from pdserve.kv_transfer.remote.admission import StoreAdmission
from pdserve.kv_transfer.remote.decision import FetchDecision
from pdserve.kv_transfer.remote.names import BlockName, KVIdentity
from pdserve.kv_transfer.remote.plan import StorePlanner
from pdserve.kv_transfer.tiers.index import TierIndex
from pdserve.kv_transfer.tiers.policies.admission import Doorkeeper, Gated
from pdserve.kv_transfer.tiers.policies.registry import make_admission, make_policy
from pdserve.launch.up_store import KvStoreUp
from pdserve.worker.metrics import WorkerCollector, WorkerSample

if TYPE_CHECKING:
    from vllm.v1.request import Request

BS = 4
IDENT = KVIdentity("fp-adm", "default", "float32", "cpu:test", BS, (2, 2, 8))



class FakeStore:
    """Holds keys; a lookup finds the leading run of a prompt's names it holds."""

    def __init__(self) -> None:
        self.held: set[str] = set()

    def lookup_prefix(self, names: Sequence[BlockName]) -> int:
        n = 0
        while n < len(names) and names[n].key in self.held:
            n += 1
        return n

    def close(self) -> None:
        pass


def _planner(admission: str, store: FakeStore | None = None) -> StorePlanner:
    decision = FetchDecision(block_bytes=2 * 2 * BS * 8 * 4, block_size=BS, per_token_s=1e-3)
    opened = store or FakeStore()
    return StorePlanner(lambda: opened, IDENT, BS, decision, 60.0,  # type: ignore
                        admission=StoreAdmission.named(admission))


def _tokens(tag: int, num_blocks: int = 5) -> list[int]:
    return [tag * 1000 + i for i in range(num_blocks * BS + 1)]


def _save(plan: StorePlanner, req_id: str, tokens: list[int], skip: int = 0) -> list[str]:
    """The keys ``plan`` queues to publish for a finished request of ``tokens``."""
    meta = PdserveConnectorMetadata()
    request = cast("Request", FakeRequest(req_id, tokens, num_computed_tokens=len(tokens)))
    plan.plan_save(request, list(range(len(tokens) // BS)), meta, skip)
    copy = meta.store_saves.get(req_id)
    return [] if copy is None else [n.key for n in copy.names]


def _keys(plan: StorePlanner, tokens: list[int]) -> list[str]:
    return [n.key for n in plan.names(cast("Request", FakeRequest("k", tokens)), len(tokens) // BS)]


# ---- the policy ------------------------------------------------------------------------

def test_the_doorkeeper_admits_a_key_at_its_second_want_and_a_hit_is_a_want() -> None:
    door = Doorkeeper(1000)
    assert not door.admit(b"once-key", 0.0, None)
    assert door.admit(b"once-key", 1.0, None)
    door.record_access(b"read-key", 0.0)  # found by a lookup: one want already
    assert door.admit(b"read-key", 1.0, None)
    assert not door.admit(b"fresh-key", 1.0, None)
    cells = len(door.sketch._counts)
    for i in range(50_000):  # a flood of one-hit wonders: its memory stays the sketch's
        door.admit(i.to_bytes(8, "little"), 2.0, None)
    assert len(door.sketch._counts) == cells


def test_a_tier_behind_the_doorkeeper_gives_no_slot_to_a_block_wanted_once() -> None:
    policy = make_policy("doorkeeper:default", 4)
    assert isinstance(policy, Gated) and isinstance(policy.gate, Doorkeeper)
    index = TierIndex(4, policy)
    assert index.reserve([b"a" * 8, b"b" * 8]) == []  # wanted once each
    assert [i for i, _ in index.reserve([b"a" * 8, b"c" * 8])] == [0]  # a: second want
    assert [i for i, _ in TierIndex(4, make_policy("default", 4)).reserve(
        [b"a" * 8, b"b" * 8])] == [0, 1]  # without it, both


def test_a_bad_admission_name_lists_the_valid_ones() -> None:
    assert make_admission("all", 10) is None
    with pytest.raises(ValueError, match="unknown KV store admission 'often'; valid: all, lru"):
        make_admission("often", 10)
    with pytest.raises(ValueError, match="doorkeeper:doorkeeper is not a policy"):
        make_admission("doorkeeper:doorkeeper", 10)


# ---- the planner -----------------------------------------------------------------------

def test_a_one_hit_wonder_is_not_written_and_its_second_want_is() -> None:
    plan, every = _planner("doorkeeper"), _planner("all")
    tokens = _tokens(1)
    assert _save(every, "e1", tokens) == _keys(every, tokens)  # all: written at once
    assert _save(plan, "r1", tokens) == []
    assert plan.take_counts()["store_not_admitted"] == 5
    assert _save(plan, "r2", tokens) == _keys(plan, tokens)  # wanted twice: all five
    assert "store_not_admitted" not in plan.take_counts()


def test_a_refused_block_stops_the_rest_of_its_requests_run() -> None:
    plan = _planner("doorkeeper")
    tokens = _tokens(2)
    keys = _keys(plan, tokens)
    assert _save(plan, "tail", tokens, skip=2) == []  # blocks 2-4 wanted once
    assert _save(plan, "head", tokens[:BS + 1]) == []  # block 0 wanted once
    assert plan.take_counts()["store_not_admitted"] == 3 + 1
    # block 0 admitted, 1 refused (its first want), 2-4 admitted but after the hole
    assert _save(plan, "r", tokens) == keys[:1]
    assert plan.take_counts()["store_not_admitted"] == 4
    # every block was asked: the next request writes the whole run (block 0 too: it
    # is not known published until the writer says so)
    assert _save(plan, "again", tokens) == keys


def test_a_lookup_hit_counts_as_a_want() -> None:
    store = FakeStore()
    reader, cold = _planner("doorkeeper", store), _planner("doorkeeper", store)
    tokens = _tokens(3)
    store.held.update(_keys(reader, tokens))
    assert reader.match(cast("Request", FakeRequest("m", tokens)), 0) == 5 * BS  # found: five wants
    reader.unmatch("m")
    store.held.clear()  # the server evicted them: they are published again
    assert _save(reader, "after-hit", tokens) == _keys(reader, tokens)
    assert _save(cold, "no-hit", tokens) == []  # the same want without the lookup


def test_the_count_reaches_metrics_at_zero_and_with_its_value() -> None:
    health = WorkerHealth(True, "prefill", "p0", "m", transport="tcp")

    async def collect(load: WorkerLoadReport) -> dict[str, float]:
        async def sampler() -> WorkerSample:
            return WorkerSample(True, load, "prefill")

        collector = WorkerCollector(health, sampler, asyncio.get_running_loop())
        families = await asyncio.to_thread(lambda: list(collector.collect()))
        return {s.name: s.value for f in families for s in f.samples}

    name = "pdserve:kv_store_not_admitted_total"
    assert asyncio.run(collect(WorkerLoadReport()))[name] == 0
    assert asyncio.run(collect(WorkerLoadReport(kv_store_not_admitted=7)))[name] == 7


# ---- the flag ------------------------------------------------------------------------

def test_the_flag_and_its_env_variable_reach_the_connector(
        monkeypatch: pytest.MonkeyPatch) -> None:
    args = build_parser().parse_args(["prefill", "--kv-store", "redis://r:6379"])
    assert connector_config(args, "p0", "127.0.0.1").kv_store_admission == "all"
    args = build_parser().parse_args(["decode", "--kv-store-admission", "doorkeeper"])
    assert connector_config(args, "d0", "127.0.0.1").kv_store_admission == "doorkeeper"
    monkeypatch.setenv("PDSERVE_KV_STORE_ADMISSION", "doorkeeper:lru")
    args = build_parser().parse_args(["prefill"])
    assert connector_config(args, "p0", "127.0.0.1").kv_store_admission == "doorkeeper:lru"


def test_up_hands_the_admission_to_its_workers() -> None:
    args = build_parser().parse_args(["up", "--kv-store", "redis://r:6379", "--dtype",
                                      "float32", "--kv-store-admission", "doorkeeper"])
    store = up_config(args, ResolvedModel(Path("/m"), "m")).kv_store
    assert store.admission == "doorkeeper"
    worker = build_parser().parse_args(["prefill", *store.flags()])
    assert connector_config(worker, "p0", "127.0.0.1").kv_store_admission == "doorkeeper"
    assert "--kv-store-admission" not in KvStoreUp(url="redis://r:6379").flags()
    with pytest.raises(ValueError, match="unknown KV store admission"):
        KvStoreUp(url="redis://r:6379", admission="often")


def test_a_bad_name_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["prefill", "--kv-store-admission", "often"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--kv-store-admission" in err and "valid: all" in err


# ---- cache-sim --admission -----------------------------------------------------------

def _trace(requests: list[list[int]]) -> Trace:
    return Trace("t", tuple(float(i) for i in range(len(requests))),
                 tuple(tuple(block_key(i) for i in r) for r in requests))


def test_cache_sim_replays_the_admission_in_front_of_the_tier() -> None:
    # [1] and [3] are first wants; [1,2,3] then admits 1, refuses 2 (first want) and so
    # saves only 1 (3 comes after the hole); the next [1,2,3] hits 1 and saves 2, 3.
    trace = _trace([[1], [3], [1, 2, 3], [1, 2, 3], [1, 2, 3]])
    gated = replay(trace, "lru", 1000, "doorkeeper")
    assert (gated.num_hit_blocks, gated.num_not_admitted, gated.num_saved_blocks) == (4, 4, 3)
    assert gated.admission == "doorkeeper"
    plain = replay(trace, "lru", 1000)
    assert (plain.num_hit_blocks, plain.num_not_admitted, plain.num_saved_blocks) == (7, 0, 3)
    with pytest.raises(ValueError, match="valid: all"):
        CacheSimConfig("t.jsonl", admission="often")
