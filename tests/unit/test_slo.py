"""The SLO-driven local/remote choice (``router/slo.py``) on constructed estimates: each
branch, objectives met and missed, derived objectives, and the static rules while the
engines have not measured their steps (start-up)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.router.dispatch.policies.disagg import DisaggConfig, choose_disagg
from pdserve.router.dispatch.policies.placement import PlacementRequest
from pdserve.router.dispatch.policies.slo import SloConfig, choose_by_slo, estimate
from pdserve.router.dispatch.workers.state import StepCost, WorkerLoad, WorkerState

# A small model on one CPU core: 40 ms a step, 5 ms per decoding sequence, 1 ms per
# prompt token (1000 tokens: 1 s).
COST = StepCost(0.040, 0.005, 0.001, decode_measured=True, prefill_measured=True)
SLO = SloConfig(ttft_s=2.0, itl_s=0.2)


def prefill(queued_tokens: int = 0, cost: StepCost | None = COST) -> WorkerState:
    return WorkerState("p:1", "prefill", healthy=True, load=WorkerLoad(step=cost),
                       num_assigned_tokens=queued_tokens, compatibility_hash="h")


def decode(running: int = 0, queued_tokens: int = 0, cost: StepCost | None = COST
           ) -> WorkerState:
    return WorkerState("d:1", "decode", healthy=True,
                       load=WorkerLoad(num_running_reqs=running, step=cost),
                       num_assigned=running, num_assigned_tokens=queued_tokens,
                       compatibility_hash="h")


def test_a_prompt_whose_step_fits_the_itl_objective_is_prefilled_on_decode() -> None:
    # 8 running + 1: 0.040 + 9 * 0.005 + 80 * 0.001 = 0.165 s <= 0.2 s.
    choice = choose_by_slo(SLO, PlacementRequest(80), prefill(), decode(running=8))
    assert choice is not None and (choice.decision, choice.reason) == ("local", "slo_local")
    assert choice.estimate.local_step_s == pytest.approx(0.165)


def test_a_prompt_that_would_stretch_a_decode_step_past_the_itl_objective_goes_remote() -> None:
    # Local: 0.040 + 0.005 + 1200 * 0.001 = 1.245 s per step for every running stream.
    # Remote: 0.040 + 1.2 = 1.24 s <= 2 s TTFT.
    choice = choose_by_slo(SLO, PlacementRequest(1200), prefill(), decode())
    assert choice is not None and (choice.decision, choice.reason) == ("remote", "slo_remote")
    assert choice.estimate.remote_ttft_s == pytest.approx(1.24)


def test_local_prefills_already_queued_on_decode_count_against_its_step() -> None:
    fits = choose_by_slo(SLO, PlacementRequest(80), prefill(), decode(running=2))
    queued = choose_by_slo(SLO, PlacementRequest(80), prefill(),
                           decode(running=2, queued_tokens=200))
    assert fits is not None and fits.decision == "local"
    assert queued is not None and queued.decision == "remote"


def test_neither_meets_the_objectives_the_cheaper_ttft_wins() -> None:
    # Prefill has 5000 tokens queued: remote TTFT 6.2 s; local step 1.245 s: local
    # breaks ITL but is the cheaper TTFT.
    choice = choose_by_slo(SLO, PlacementRequest(1200), prefill(queued_tokens=5000), decode())
    assert choice is not None and (choice.decision, choice.reason) == (
        "local", "slo_missed_local")
    # A busy decode (40 running): local 1.445 s per step, still below remote's 6.2 s.
    # With prefill's queue short, remote (1.24 s) meets TTFT again.
    choice = choose_by_slo(SLO, PlacementRequest(1200), prefill(queued_tokens=300),
                           decode(running=40))
    assert choice is not None and (choice.decision, choice.reason) == ("remote", "slo_remote")
    # Both miss, remote cheaper: a tight TTFT objective, a decode crowded with prefills.
    tight = SloConfig(ttft_s=0.5, itl_s=0.2)
    choice = choose_by_slo(tight, PlacementRequest(400), prefill(queued_tokens=200),
                           decode(running=4, queued_tokens=800))
    assert choice is not None and (choice.decision, choice.reason) == (
        "remote", "slo_missed_remote")


def test_prefix_caches_lower_each_side_s_cost() -> None:
    """Decode holding the prompt's prefix computes only the rest: then it fits."""
    request = PlacementRequest(1200)
    chosen = choose_by_slo(SLO, request, prefill(), decode())
    assert chosen is not None and chosen.decision == "remote"
    cached = choose_by_slo(SLO, request, prefill(), decode(), decode_cached_tokens=1100)
    assert cached is not None and cached.decision == "local"


def test_unset_objectives_are_derived_from_the_measurements() -> None:
    est = estimate(SloConfig(), PlacementRequest(500), prefill(), decode())
    assert est is not None
    assert est.itl_slo_s == pytest.approx(2 * (0.040 + 0.005))  # 2x an unloaded step
    assert est.ttft_slo_s == pytest.approx(3 * (0.040 + 0.5))  # 3x its unloaded prefill


def test_decode_borrows_prefill_s_per_token_cost_until_it_has_prefilled() -> None:
    decode_only = dataclasses.replace(COST, per_token_s=0.0, prefill_measured=False)
    est = estimate(SLO, PlacementRequest(1200), prefill(), decode(cost=decode_only))
    assert est is not None and est.local_step_s == pytest.approx(1.245)


@pytest.mark.parametrize(("p_cost", "d_cost"), [
    (None, COST), (COST, None),
    (dataclasses.replace(COST, prefill_measured=False), COST),
    (COST, dataclasses.replace(COST, decode_measured=False)),
])
def test_missing_measurements_leave_the_static_rules_deciding(
        p_cost: StepCost | None, d_cost: StepCost | None) -> None:
    """At start-up an engine has measured nothing: no SLO choice; ``auto`` falls back to
    the static rules (a 1200-token prompt is long_prompt, an 80-token one short)."""
    p, d = prefill(cost=p_cost), decode(cost=d_cost)
    assert choose_by_slo(SLO, PlacementRequest(1200), p, d) is None
    config = DisaggConfig("slo", slo=SLO)
    long = choose_disagg(config, PlacementRequest(1200), p, d)
    short = choose_disagg(config, PlacementRequest(80), p, d)
    assert (long.reason, short.reason) == ("long_prompt", "short_prompt")
    assert long.estimate is None


def test_slo_mode_uses_the_slo_rule_and_the_decision_carries_its_estimate() -> None:
    decision = choose_disagg(DisaggConfig("slo", slo=SLO), PlacementRequest(1200), prefill(),
                             decode())
    assert (decision.decision, decision.reason) == ("remote", "slo_remote")
    assert decision.estimate is not None and decision.header() == "remote; reason=slo_remote"
    # auto keeps the static rules, measured costs or not.
    static = choose_disagg(DisaggConfig("auto", slo=SLO), PlacementRequest(80), prefill(),
                           decode())
    assert (static.reason, static.estimate) == ("short_prompt", None)
    # always / never / no prefill are not the SLO's to decide.
    assert choose_disagg(DisaggConfig("always", slo=SLO), PlacementRequest(80), prefill(),
                         decode()).reason == "always"
    assert choose_disagg(DisaggConfig("slo", slo=SLO), PlacementRequest(80), None,
                         decode()).reason == "no_prefill"


def test_objectives_must_not_be_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        SloConfig(ttft_s=-1)


def test_a_decode_engine_that_chunks_prefill_spreads_a_long_prompt_over_steps() -> None:
    """With 128 prompt tokens per step (``prefill_chunk_tokens``), a 1,200-token prompt
    takes 10 steps of at most 0.173 s: within the ITL objective; its first token comes
    after all 10 (1.245 s + 9 step bases), within TTFT: prefilled on decode, where the
    same engine without chunking would break every stream's ITL."""
    chunked = dataclasses.replace(decode(), prefill_chunk_tokens=128)
    est = estimate(SLO, PlacementRequest(1200), prefill(queued_tokens=5000), chunked)
    assert est is not None
    assert est.local_step_s == pytest.approx(0.040 + 0.005 + 0.128)
    assert est.local_ttft_s == pytest.approx(9 * 0.173 + 0.040 + 0.005 + 0.048)
    choice = choose_by_slo(SLO, PlacementRequest(1200), prefill(queued_tokens=5000), chunked)
    assert choice is not None and (choice.decision, choice.reason) == ("local", "slo_local")
    whole = choose_by_slo(SLO, PlacementRequest(1200), prefill(queued_tokens=5000), decode())
    assert whole is not None and whole.reason == "slo_missed_local"
