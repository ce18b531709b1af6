"""Conditional disaggregation (``router/disagg.py``): the rule that sends a request's
prompt to a prefill worker (``remote``) or lets decode compute it (``local``), on
constructed worker snapshots."""

from __future__ import annotations

import pytest

from pdserve.router.dispatch.policies.disagg import DisaggConfig, DisaggDecision, choose_disagg
from pdserve.router.dispatch.policies.placement import PlacementRequest
from pdserve.router.dispatch.workers.state import WorkerLoad, WorkerState

AUTO = DisaggConfig(mode="auto", local_prefill_max_tokens=256,
                    local_prefill_max_queued_tokens=4096, local_decode_max_running=4)
LONG = 600


def prefill(queued_tokens: int = 0, worker_id: str = "p0") -> WorkerState:
    return WorkerState("127.0.0.1:1", "prefill", healthy=True, worker_id=worker_id,
                       num_assigned=queued_tokens // 600, num_assigned_tokens=queued_tokens)


def decode(num_assigned: int = 0, running: int = 0, waiting: int = 0,
           local_tokens: int = 0) -> WorkerState:
    return WorkerState("127.0.0.1:2", "decode", healthy=True, worker_id="d0",
                       num_assigned=num_assigned, num_assigned_tokens=local_tokens,
                       load=WorkerLoad(num_running_reqs=running, num_waiting_reqs=waiting))


def request(num_prompt: int, matched_on_p0: int = 0) -> PlacementRequest:
    return PlacementRequest(num_prompt, {"p0": matched_on_p0} if matched_on_p0 else {})


def test_short_prompt_is_local() -> None:
    assert choose_disagg(AUTO, request(40), prefill(), decode()) == DisaggDecision(
        "local", "short_prompt")
    assert choose_disagg(AUTO, request(256), prefill(), decode()).reason == "short_prompt"


def test_long_prompt_with_idle_prefill_is_remote() -> None:
    decision = choose_disagg(AUTO, request(LONG), prefill(), decode())
    assert decision == DisaggDecision("remote", "long_prompt")
    assert decision.remote and decision.header() == "remote; reason=long_prompt"


def test_long_prompt_cached_on_prefill_stays_remote() -> None:
    """Prefill's cache makes the remote path cheaper, not the local one: decode would
    compute the whole prompt."""
    decision = choose_disagg(AUTO, request(LONG, matched_on_p0=512), prefill(), decode())
    assert decision == DisaggDecision("remote", "long_prompt")


def test_long_prompt_with_saturated_prefill_and_idle_decode_is_local() -> None:
    decision = choose_disagg(AUTO, request(LONG), prefill(queued_tokens=6000), decode())
    assert decision == DisaggDecision("local", "prefill_busy")


@pytest.mark.parametrize("busy_decode", [
    decode(num_assigned=5), decode(running=3, waiting=2), decode(num_assigned=1, running=8)])
def test_saturated_prefill_with_busy_decode_stays_remote(busy_decode: WorkerState) -> None:
    decision = choose_disagg(AUTO, request(LONG), prefill(queued_tokens=6000), busy_decode)
    assert decision == DisaggDecision("remote", "long_prompt")


def test_saturated_prefill_keeps_an_enormous_prompt_remote() -> None:
    """A prompt larger than the queue threshold would stall decode's streams longer."""
    decision = choose_disagg(AUTO, request(5000), prefill(queued_tokens=6000), decode())
    assert decision == DisaggDecision("remote", "long_prompt")


def test_queue_at_the_threshold_is_not_busy() -> None:
    decision = choose_disagg(AUTO, request(LONG), prefill(queued_tokens=4096), decode())
    assert decision.remote


def test_decode_already_holding_the_prefix_is_local() -> None:
    decision = choose_disagg(AUTO, request(LONG), prefill(), decode(),
                             decode_cached_tokens=512)
    assert decision == DisaggDecision("local", "decode_cached")
    partly = choose_disagg(AUTO, request(LONG), prefill(), decode(), decode_cached_tokens=128)
    assert partly.remote
    # Local prompt tokens already queued on decode count: 88 + 168 fits the 256 budget,
    # 88 + 169 does not (the turn goes remote, decoding only its new blocks' KV).
    fits = choose_disagg(AUTO, request(LONG), prefill(), decode(local_tokens=168),
                         decode_cached_tokens=512)
    assert fits == DisaggDecision("local", "decode_cached")
    over = choose_disagg(AUTO, request(LONG), prefill(), decode(local_tokens=169),
                         decode_cached_tokens=512)
    assert over == DisaggDecision("remote", "long_prompt")


def test_always_and_never_ignore_the_prompt() -> None:
    always, never = DisaggConfig(mode="always"), DisaggConfig(mode="never")
    for num_prompt in (4, LONG):
        assert choose_disagg(always, request(num_prompt), prefill(), decode()) == (
            DisaggDecision("remote", "always"))
        assert choose_disagg(never, request(num_prompt), prefill(), decode()) == (
            DisaggDecision("local", "never"))


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
def test_no_prefill_is_local(mode: str) -> None:
    config = DisaggConfig(mode=mode)  # type: ignore[arg-type]
    assert choose_disagg(config, request(LONG), None, decode()) == DisaggDecision(
        "local", "no_prefill")


def test_decision_is_pure() -> None:
    p, d, r = prefill(queued_tokens=6000), decode(), request(LONG)
    before = (p, d, r)
    decisions = {choose_disagg(AUTO, r, p, d) for _ in range(3)}
    assert len(decisions) == 1 and (p, d, r) == before


def test_config_refuses_unknown_modes_and_negative_thresholds() -> None:
    with pytest.raises(ValueError, match="valid modes: auto, always, never"):
        DisaggConfig(mode="sometimes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="local_prefill_max_tokens"):
        DisaggConfig(local_prefill_max_tokens=-1)
