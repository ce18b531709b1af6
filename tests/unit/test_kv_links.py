"""The link meter (``kv_transfer/links.py``) and what the router makes of it
(``link_cost.py``, the ``slow_link`` rule of ``choose_disagg``, the ``slo`` rule's
transfer): a thin path moves a long prompt's prefill to decode, a fast one does not, and
``--no-link-aware`` ignores the path."""

from __future__ import annotations

import pytest

from pdserve.core.types import KvLink
from pdserve.kv_transfer.links import MIN_SAMPLE_BYTES, LinkMeter
from pdserve.router.dispatch.policies.disagg import DisaggConfig, choose_disagg
from pdserve.router.dispatch.policies.link_cost import transfer_s
from pdserve.router.dispatch.policies.placement import (
    PlacementRequest,
    create_placement,
    path_tokens,
)
from pdserve.router.dispatch.workers.state import StepCost, WorkerLoad, WorkerState

MIB = 1 << 20
PEER = "10.0.0.7:7000"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_small_pull_is_no_sample_and_a_large_one_is() -> None:
    meter = LinkMeter()
    meter.record(PEER, MIN_SAMPLE_BYTES - 1, 16, 0.001)
    assert meter.estimates() == []
    meter.record(PEER, 8 * MIB, 128, 0.08)  # 100 MiB/s
    (link,) = meter.estimates()
    assert (link.peer, link.samples) == (PEER, 1)
    assert link.bytes_per_s == pytest.approx(100 * MIB)
    assert link.bytes_per_token == 8 * MIB / 128


def test_one_slow_pull_pulls_the_estimate_most_of_the_way_down() -> None:
    meter = LinkMeter()
    meter.record(PEER, 100 * MIB, 1000, 0.1)  # 1000 MiB/s
    meter.record(PEER, 100 * MIB, 1000, 10.0)  # 10 MiB/s: the link got thin
    (link,) = meter.estimates()
    assert link.samples == 2
    assert 10 * MIB <= link.bytes_per_s < 15 * MIB  # within 1.5x of the new rate


def test_an_estimate_is_forgotten_after_its_max_age() -> None:
    clock = Clock()
    meter = LinkMeter(max_age_s=5.0, clock=clock)
    meter.record(PEER, 4 * MIB, 64, 0.4)
    clock.now += 4.0
    assert [e.age_s for e in meter.estimates()] == [pytest.approx(4.0)]
    clock.now += 2.0
    assert meter.estimates() == []
    meter.record(PEER, 4 * MIB, 64, 0.04)  # a fresh start, not averaged with the old
    assert meter.estimates()[0].bytes_per_s == pytest.approx(100 * MIB)


def _pair(bytes_per_s: float | None, per_token_s: float = 1e-3, decode_running: int = 0
          ) -> tuple[WorkerState, WorkerState]:
    step = StepCost(0.02, 0.001, per_token_s, True, True)
    prefill = WorkerState("p:1", "prefill", healthy=True, worker_id="p", kv_host="10.0.0.7",
                          kv_port=7000, load=WorkerLoad(step=step))
    links = () if bytes_per_s is None else (KvLink(PEER, bytes_per_s, 46_080.0, 3, 1.0),)
    decode = WorkerState("d:1", "decode", healthy=True, worker_id="d",
                         load=WorkerLoad(step=step, kv_links=links,
                                         num_running_reqs=decode_running))
    return prefill, decode


def test_the_price_is_the_tokens_kv_over_the_measured_rate() -> None:
    prefill, decode = _pair(46_080.0 * 1000)  # 1000 tokens' KV a second
    assert transfer_s(prefill, decode, 2000) == pytest.approx(2.0)
    assert transfer_s(_pair(None)[0], _pair(None)[1], 2000) is None  # not measured
    other = WorkerState("q:1", "prefill", kv_host="10.0.0.8", kv_port=7000)
    assert transfer_s(other, decode, 2000) is None  # another path


@pytest.mark.parametrize(("rate", "link_aware", "want"), [
    (46_080.0 * 100, True, ("local", "slow_link")),  # 100 tokens/s: 10 s vs 1 s computed
    (46_080.0 * 1e5, True, ("remote", "long_prompt")),  # 0.01 s to move: hand off
    (46_080.0 * 100, False, ("remote", "long_prompt")),  # --no-link-aware
    (None, True, ("remote", "long_prompt")),  # a path not measured: the old rules
])
def test_auto_computes_a_long_prompt_on_decode_when_its_path_is_too_thin(
        rate: float | None, link_aware: bool, want: tuple[str, str]) -> None:
    prefill, decode = _pair(rate)
    decision = choose_disagg(DisaggConfig("auto", link_aware=link_aware),
                             PlacementRequest(num_prompt_tokens=1000), prefill, decode)
    assert (decision.decision, decision.reason) == want
    if rate is not None and link_aware:
        assert decision.transfer_s == pytest.approx(1000 / (rate / 46_080.0))
        assert f"kv_transfer_s={decision.transfer_s:.4f}" in decision.header()
    else:
        assert decision.transfer_s is None
        assert decision.header() == f"{want[0]}; reason={want[1]}"


@pytest.mark.parametrize(("running", "want"), [
    (0, "local"),  # 1.5 s to move against 1 s computed, stalling nothing else
    (1, "remote"),  # 1 s computed stalls this stream and one other: 2 s against 1.5 s
    (3, "remote"),  # four streams stall for it: 4 s against 1.5 s
])
def test_slow_link_counts_the_stall_a_local_prefill_puts_on_decodes_streams(
        running: int, want: str) -> None:
    """A local prefill shares decode's steps: each stream it runs waits for those tokens
    too, so a path must be slower than that total for the prompt to go local."""
    prefill, decode = _pair(46_080.0 * 1000 / 1.5, decode_running=running)  # 1000: 1.5 s
    decision = choose_disagg(DisaggConfig("auto"), PlacementRequest(num_prompt_tokens=1000),
                             prefill, decode)
    assert decision.decision == want
    assert decision.transfer_s == pytest.approx(1.5)


def test_slo_counts_the_transfer_in_the_remote_route() -> None:
    # An ITL objective no local prefill of 1000 tokens meets (1 s of compute in a step).
    config = DisaggConfig("slo")
    request = PlacementRequest(num_prompt_tokens=1000)
    fast = choose_disagg(config, request, *_pair(46_080.0 * 1e6))
    assert fast.decision == "remote" and fast.estimate is not None
    thin = choose_disagg(config, request, *_pair(46_080.0 * 50))  # 20 s to move
    assert thin.estimate is not None and thin.estimate.transfer_s == pytest.approx(20.0)
    assert (thin.decision, thin.reason) == ("local", "slo_missed_local")
    assert thin.estimate.remote_stream_s == pytest.approx(thin.estimate.remote_ttft_s + 20.0)


def _prefill(host: str) -> WorkerState:
    step = StepCost(0.02, 0.001, 1e-3, True, True)  # 1 ms a prompt token
    return WorkerState(f"{host}:1", "prefill", healthy=True, worker_id=host, kv_host=host,
                       kv_port=7000, load=WorkerLoad(step=step))


def test_placement_takes_the_prefill_behind_the_faster_path() -> None:
    """Two idle prefill workers, neither caching the prompt: the decode measured 10 s a
    thousand tokens from one and 0.01 s from the other. Whatever the rotation says, the
    long prompt goes to the fast one (and to the decode it priced)."""
    thin, fast = _prefill("10.0.0.7"), _prefill("10.0.0.8")
    links = (KvLink("10.0.0.7:7000", 46_080.0 * 100, 46_080.0, 2, 1.0),
             KvLink("10.0.0.8:7000", 46_080.0 * 1e5, 46_080.0, 2, 1.0))
    decode = WorkerState("d:1", "decode", healthy=True, worker_id="d",
                         load=WorkerLoad(kv_links=links))
    request = PlacementRequest(num_prompt_tokens=1000)
    for cursor in range(4):
        choice = create_placement("cache_aware").choose([thin, fast], [decode], cursor, request)
        assert choice is not None and (choice.prefill, choice.decode) == (1, 0)
    # --no-link-aware: the path is not weighed, the rotation alternates between them.
    off = create_placement("cache_aware", link_aware=False)
    picks = {off.choose([thin, fast], [decode], c, request).prefill for c in range(4)}  # type: ignore[union-attr]
    assert picks == {0, 1}
    assert path_tokens(thin, decode, 1000) == 10_000  # 10 s at 1 ms a token
    assert path_tokens(fast, decode, 1000) == 10


def test_placement_without_measured_paths_is_unchanged() -> None:
    thin, fast = _prefill("10.0.0.7"), _prefill("10.0.0.8")
    decode = WorkerState("d:1", "decode", healthy=True, worker_id="d")
    request = PlacementRequest(num_prompt_tokens=1000)
    on, off = create_placement("cache_aware"), create_placement("cache_aware", link_aware=False)
    for cursor in range(4):
        assert on.choose([thin, fast], [decode], cursor, request) == off.choose(
            [thin, fast], [decode], cursor, request)
