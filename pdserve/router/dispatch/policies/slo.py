"""SLO-driven conditional disaggregation: per request, prefill on the decode worker
(``local``) or hand off (``remote``), from the cluster's own measured costs against the
TTFT and ITL objectives, not from fixed token thresholds.

Inputs (all measured, never assumed): each worker engine's step-time fit
(``StepCost``: base + per decoding sequence + per prompt token, from ``GetLoad``), the
prompt tokens each side would compute (prefix caches), and the prompt tokens already
queued on each side by this router (``num_assigned_tokens``). ``choose_by_slo`` is a
pure function of them (placement's snapshots); it returns None while an engine has not
measured the steps it needs (start-up): the caller then keeps the static rules.

- Local costs decode the steps carrying this prompt's prefill (and the local prefills
  queued before it) beside its running sequences: one step, or, where the engine
  caps a request's prompt tokens per step (``prefill_chunk_tokens``: chunked prefill),
  one step per chunk. It *fits* when each such step stays within the ITL objective
  (no running stream sees a longer gap than the SLO allows) and the last one ends
  within the TTFT objective.
- Remote costs the prefill worker's queue plus this prompt's compute: its TTFT; and, where
  the router prices the path (``--link-aware``, ``link_cost.py``), the KV's transfer to
  decode, which holds the stream after the first token: remote's time to stream is the
  sum (with layer-wise push the transfer overlaps the compute: the sum overprices it).
- The rule: local when it fits the ITL objective and meets the TTFT one (one cheap
  step, no handoff); else remote when it meets TTFT; else the cheaper TTFT of the two.

Unset objectives are derived per request from the same measurements, as the benchmarks
derive their SLOs from an unloaded system: TTFT 3x this prompt's unloaded prefill on the
prefill worker, ITL 2x an unloaded decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.router.dispatch.policies.placement import PlacementRequest
from pdserve.router.dispatch.workers.state import StepCost, WorkerState

SloReason = Literal["slo_local", "slo_remote", "slo_missed_local", "slo_missed_remote"]
SLO_REASONS: tuple[SloReason, ...] = ("slo_local", "slo_remote", "slo_missed_local",
                                      "slo_missed_remote")
# Derived objectives, as ``pdserve bench`` derives SLOs from an unloaded run.
DERIVED_TTFT_FACTOR = 3.0
DERIVED_ITL_FACTOR = 2.0


@dataclass(frozen=True)
class SloConfig:
    """``ttft_s`` / ``itl_s``: the objectives; 0 derives each from the measurements."""

    ttft_s: float = 0.0
    itl_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ttft_s < 0 or self.itl_s < 0:
            raise ValueError("SLO objectives must be >= 0 (0: derived)")


@dataclass(frozen=True)
class SloEstimate:
    """What one decision weighed (seconds); the router exports the latest."""

    local_step_s: float  # decode's longest step with this prompt's prefill in it
    remote_ttft_s: float
    ttft_slo_s: float
    itl_slo_s: float
    # Prefilled on decode, the first token comes at the end of the last step carrying
    # the prompt (with no chunking: that one step).
    local_ttft_s: float
    # The KV's transfer to decode on its path (0: not priced); remote streams after
    # ``remote_ttft_s + transfer_s``.
    transfer_s: float = 0.0

    @property
    def remote_stream_s(self) -> float:
        return self.remote_ttft_s + self.transfer_s

    @property
    def local_fits(self) -> bool:
        return self.local_step_s <= self.itl_slo_s and self.local_ttft_s <= self.ttft_slo_s


@dataclass(frozen=True)
class SloChoice:
    decision: Literal["local", "remote"]
    reason: SloReason
    estimate: SloEstimate


def estimate(slo: SloConfig, request: PlacementRequest, prefill: WorkerState,
             decode: WorkerState, decode_cached_tokens: int = 0,
             transfer_s: float = 0.0) -> SloEstimate | None:
    """The costs of both routes for ``request``, or None while either engine lacks the
    measurements (decode: a decode step; prefill: a step computing prompt tokens)."""
    p, d = prefill.load.step, decode.load.step
    if p is None or d is None or not (p.prefill_measured and d.decode_measured):
        return None
    local_tokens = max(request.num_prompt_tokens - decode_cached_tokens, 1)
    running = max(decode.num_assigned, decode.load.num_running_reqs)
    before = decode.num_assigned_tokens  # local prefills queued ahead of this one
    cost = _per_token(d, p)
    chunk = decode.prefill_chunk_tokens
    if not chunk or local_tokens <= chunk:
        # One step carries this prompt, and (at most) everything queued before it.
        local_step = cost.seconds(running + 1, before + local_tokens)
        local_ttft = local_step
    else:
        # The engine caps each request's prompt tokens per step, not the step: the queued
        # prompts' chunks ride in the same steps as this one's (at most all of them).
        steps = -(-local_tokens // chunk)
        local_step = cost.seconds(running + 1, before + chunk)
        local_ttft = (steps - 1) * local_step + cost.seconds(
            running + 1, before + local_tokens - (steps - 1) * chunk)
    remote_tokens = request.uncached_tokens(prefill)
    remote_ttft = p.seconds(0, prefill.num_assigned_tokens + remote_tokens)
    ttft_slo = slo.ttft_s or DERIVED_TTFT_FACTOR * p.seconds(0, remote_tokens)
    itl_slo = slo.itl_s or DERIVED_ITL_FACTOR * d.seconds(1, 0)
    return SloEstimate(local_step, remote_ttft, ttft_slo, itl_slo, local_ttft, transfer_s)


def choose_by_slo(slo: SloConfig, request: PlacementRequest, prefill: WorkerState,
                  decode: WorkerState, decode_cached_tokens: int = 0,
                  transfer_s: float = 0.0) -> SloChoice | None:
    """Local, remote, or the cheaper when neither meets the objectives (module
    docstring); None when the measurements are missing. ``transfer_s``: the KV's
    transfer on its path (0: not priced)."""
    est = estimate(slo, request, prefill, decode, decode_cached_tokens, transfer_s)
    if est is None:
        return None
    if est.local_fits:
        return SloChoice("local", "slo_local", est)
    if est.remote_stream_s <= est.ttft_slo_s:
        return SloChoice("remote", "slo_remote", est)
    if est.local_ttft_s <= est.remote_stream_s:
        return SloChoice("local", "slo_missed_local", est)
    return SloChoice("remote", "slo_missed_remote", est)


def decode_step_cost(prefill: WorkerState, decode: WorkerState) -> StepCost | None:
    """Decode's step fit with a per-token cost (its own, or the prefill engine's: the
    same model on the same kind of core), or None before both have measured."""
    p, d = prefill.load.step, decode.load.step
    if p is None or d is None or not (p.prefill_measured or d.prefill_measured):
        return None
    return _per_token(d, p)


def _per_token(decode: StepCost, prefill: StepCost) -> StepCost:
    """Decode's fit, with the prefill engine's measured per-token cost where decode has
    not computed prompt tokens yet (the same model on the same kind of core)."""
    if decode.prefill_measured:
        return decode
    return StepCost(decode.base_s, decode.per_seq_s, prefill.per_token_s, True, True)
