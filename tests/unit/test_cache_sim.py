"""``pdserve bench cache-sim``: LRU, S3-FIFO and Belady replayed through the tiers' own index and
policies agree with plain reference implementations written here, on the committed
Mooncake sample and on random small traces; the objects replayed are the registry's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.micro.cache_sim.main import run
from pdserve.bench.micro.cache_sim.replay import replay
from pdserve.bench.micro.cache_sim.trace import Trace, block_key, load_trace
from pdserve.bench.micro.configs import CacheSimConfig
from pdserve.kv_transfer.tiers.policies.lru import LruPolicy
from pdserve.kv_transfer.tiers.policies.registry import make_policy

SAMPLE = Path(__file__).parent.parent / "data" / "mooncake_conversation_sample.jsonl"
Requests = list[list[int]]


def _trace(requests: Requests) -> Trace:
    return Trace("t", tuple(0.0 for _ in requests),
                 tuple(tuple(block_key(i) for i in r) for r in requests))


def _prefix(ids: list[int], held: object) -> int:
    n = 0
    for k in ids:
        if k not in held:  # type: ignore[operator]
            break
        n += 1
    return n


def ref_lru(requests: Requests, cap: int) -> int:
    """A list, least recently used first. A request's new blocks land after its
    victims were chosen (a tier writes them), so they are never its own victims."""
    order: list[int] = []
    hits = 0
    for ids in requests:
        n = _prefix(ids, order)
        hits += n
        for k in ids[:n]:
            order.remove(k)
            order.append(k)
        new: list[int] = []
        for k in ids:
            if k in order:
                order.remove(k)
                order.append(k)
                continue
            if k in new:
                continue
            if len(order) + len(new) >= cap:
                if not order:
                    break
                order.pop(0)
            new.append(k)
        order += new
    return hits


def ref_s3fifo(requests: Requests, cap: int) -> int:
    """Three lists: small (10 %), main, ghost (4× the tier's keys); counts capped at 3.
    Victims are chosen while a request's blocks are reserved, its new blocks enter
    after (a ghost's straight to main)."""
    small: list[int] = []
    main: list[int] = []
    ghost: list[int] = []
    freq: dict[int, int] = {}
    small_slots, ghost_slots = max(round(cap * 0.1), 1), round(cap * 4.0)

    def evict() -> None:
        while True:
            if len(small) >= small_slots or not main:
                k = small.pop(0)
                if freq[k] > 0:
                    freq[k] = 0
                    main.append(k)
                    continue
                del freq[k]
                ghost.append(k)
                if len(ghost) > ghost_slots:
                    ghost.pop(0)
                return
            k = main.pop(0)
            if freq[k] > 0:
                freq[k] -= 1
                main.append(k)
                continue
            del freq[k]
            return

    hits = 0
    for ids in requests:
        n = _prefix(ids, freq)
        hits += n
        new: list[int] = []
        for k in ids[:n] + ids:  # the match's accesses, then the save's
            if k in freq:
                freq[k] = min(freq[k] + 1, 3)
            elif k not in new:
                if len(freq) + len(new) >= cap:
                    if not freq:
                        break
                    evict()
                new.append(k)
        for k in new:
            freq[k] = 0
            if k in ghost:
                ghost.remove(k)
                main.append(k)
            else:
                small.append(k)
    return hits


def ref_belady(requests: Requests, cap: int) -> int:
    """Evict the held block whose next reference (after the one being saved) is
    farthest, found by scanning the rest of the trace."""
    flat = [k for ids in requests for k in ids]
    held: set[int] = set()
    hits = start = 0
    for ids in requests:
        end = start + len(ids)
        n = _prefix(ids, held)
        hits += n
        later: dict[int, int] = {}  # each block's first reference after this request
        for p in range(end, len(flat)):
            later.setdefault(flat[p], p)
        new: list[int] = []
        for i, k in enumerate(ids):
            if k in held or k in new:
                continue
            if len(held) + len(new) >= cap:
                if not held:
                    break
                rest = {b: start + j for j, b in enumerate(ids) if j > i}

                def next_use(block: int, rest: dict[int, int] = rest,
                             later: dict[int, int] = later) -> int:
                    return rest.get(block, later.get(block, len(flat)))

                held.remove(max(held, key=next_use))
            new.append(k)
        held |= set(new)
        start = end
    return hits


def _sample(limit: int = 150) -> Requests:
    lines = SAMPLE.read_text().splitlines()[:limit]
    return [json.loads(line)["hash_ids"] for line in lines]


@pytest.mark.parametrize("cap", [100, 400, 1500])
def test_lru_and_belady_match_the_references_on_the_mooncake_sample(cap: int) -> None:
    requests = _sample()
    trace = load_trace(SAMPLE)
    assert replay(trace, "lru", cap).num_hit_blocks == ref_lru(requests, cap)
    assert replay(trace, "s3fifo", cap).num_hit_blocks == ref_s3fifo(requests, cap)
    assert replay(trace, "belady", cap).num_hit_blocks == ref_belady(requests, cap)


def test_the_sample_has_reuse_so_the_comparison_can_fail() -> None:
    trace = load_trace(SAMPLE)
    small, large = replay(trace, "lru", 400), replay(trace, "infinite", 0)
    assert 0 < small.num_hit_blocks < large.num_hit_blocks
    assert replay(trace, "belady", 400).num_hit_blocks > small.num_hit_blocks


_requests = st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True),
                     min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(requests=_requests, cap=st.integers(1, 10))
def test_lru_and_belady_match_the_references_on_random_traces(requests: Requests,
                                                              cap: int) -> None:
    trace = _trace(requests)
    assert replay(trace, "lru", cap).num_hit_blocks == ref_lru(requests, cap)
    assert replay(trace, "s3fifo", cap).num_hit_blocks == ref_s3fifo(requests, cap)
    assert replay(trace, "belady", cap).num_hit_blocks == ref_belady(requests, cap)


@pytest.mark.parametrize("spec", ["lru", "default", "s3fifo", "wtinylfu", "ttl:60", "quota:lru",
                                  "doorkeeper:lru"])
def test_the_replayed_policy_is_the_registrys_own_class(spec: str) -> None:
    made = type(make_policy(spec, 100))
    result = replay(load_trace(SAMPLE), spec, 100)
    assert result.policy_class == f"{made.__module__}.{made.__qualname__}"


def test_patching_the_production_policy_changes_what_the_simulator_reports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    trace = load_trace(SAMPLE)
    before = replay(trace, "lru", 200)
    # The tier's own LRU evicting the most recently used instead: the replay follows it.
    monkeypatch.setattr(LruPolicy, "victim", lambda self, now, evictable, tenant: next(
        (k for k in reversed(self._order) if evictable(k)), None))
    after = replay(trace, "lru", 200)
    assert after.num_hit_blocks != before.num_hit_blocks


def test_the_command_prints_one_json_line_per_policy_and_capacity(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "r.jsonl"
    config = CacheSimConfig(str(SAMPLE), (50, 100), ("lru", "belady", "infinite"), str(out))
    assert run(config) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(d["policy"], d["capacity_blocks"]) for d in lines[:4]] == [
        ("lru", 50), ("lru", 100), ("belady", 50), ("belady", 100)]
    assert lines[4]["policy"] == "infinite" and len(lines) == 5
    for d in lines:
        assert d["num_requests"] == 150 and d["hit_ratio"] == d["num_hit_blocks"] / d[
            "num_block_refs"]
    assert len(out.read_text().splitlines()) == 5


def test_a_bad_trace_or_policy_is_one_error(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert run(CacheSimConfig(str(bad))) == 2
    assert "bad.jsonl:1" in capsys.readouterr().err
    with pytest.raises(ValueError, match="valid policies: lru"):
        CacheSimConfig(str(SAMPLE), policy=("nope",))
