"""Conditional disaggregation: per request, prefill on a prefill worker and hand the KV
to decode (``remote``), or let the decode worker prefill the prompt itself (``local``).

On equal hardware a handoff is not free: it costs a prefill call, a KV transfer and a
second admission on decode, while a short prompt prefilled on decode costs about one
decode step (the engine folds it into the running batch). So the handoff pays only for
long uncached prompts on a prefill pool that can take them now. ``choose_disagg`` is a
pure function of the snapshots placement already read: no I/O, no state, same inputs
give the same decision (as placement's policies do).

The failure fallback (the prefill call failed, decode recomputes) is not a decision:
it is counted by the dispatcher's ``pdserve:prefill_fallbacks`` alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.router.dispatch.policies.link_cost import compute_s, transfer_s
from pdserve.router.dispatch.policies.placement import PlacementRequest
from pdserve.router.dispatch.policies.slo import (
    SloConfig,
    SloEstimate,
    choose_by_slo,
    decode_step_cost,
)
from pdserve.router.dispatch.workers.state import WorkerState

DisaggMode = Literal["always", "never", "auto", "slo"]
Decision = Literal["local", "remote"]
Reason = Literal["always", "never", "no_prefill", "short_prompt", "decode_cached",
                 "prefill_busy", "slow_link", "long_prompt", "slo_local", "slo_remote",
                 "slo_missed_local", "slo_missed_remote", "sibling"]
DISAGG_MODES: tuple[DisaggMode, ...] = ("auto", "always", "never", "slo")
# Every (decision, reason) the rules can give (metric label sets known up front).
DECISION_REASONS: tuple[tuple[Decision, Reason], ...] = (
    ("remote", "always"), ("local", "never"), ("local", "no_prefill"),
    ("local", "short_prompt"), ("local", "decode_cached"), ("local", "prefill_busy"),
    ("local", "slow_link"), ("remote", "long_prompt"), ("local", "slo_local"),
    ("remote", "slo_remote"),
    ("local", "sibling"),
    ("local", "slo_missed_local"), ("remote", "slo_missed_remote"))
DEFAULT_DISAGG_MODE: DisaggMode = "auto"

# Two of vLLM's CPU KV blocks (128 tokens each). A prompt that short fits in one engine
# step of decode's chunked-prefill budget beside its running decodes, so prefilling it
# there costs about one decode step; the handoff costs a prefill call, a KV transfer and
# a second admission on decode, each at least a step's worth of round trips. Longer
# prompts stall decode's streams for several steps, which the handoff avoids. A starting
# point, not a measurement: tune it with ``bench/`` on the target hardware.
DEFAULT_LOCAL_PREFILL_MAX_TOKENS = 256
# Work ahead on the prefill worker, in uncached prompt tokens, beyond which waiting
# for it costs more than prefilling on an idle decode (about 16 prompts of 256 tokens).
DEFAULT_LOCAL_PREFILL_MAX_QUEUED_TOKENS = 4096
# "Lightly loaded" decode: a local prefill stalls each running stream for one step,
# which is acceptable for a handful of streams, not for a full batch.
DEFAULT_LOCAL_DECODE_MAX_RUNNING = 4


@dataclass(frozen=True)
class DisaggConfig:
    """``always``: every request goes prefill → decode (the handoff); ``never``: every
    request runs on decode alone; ``auto``: the static rules of ``choose_disagg``;
    ``slo``: the SLO rule on the engines' measured costs (``slo.py``), the static
    rules only until both engines have measured their steps."""

    mode: DisaggMode = DEFAULT_DISAGG_MODE
    local_prefill_max_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_TOKENS
    local_prefill_max_queued_tokens: int = DEFAULT_LOCAL_PREFILL_MAX_QUEUED_TOKENS
    local_decode_max_running: int = DEFAULT_LOCAL_DECODE_MAX_RUNNING
    # ``slo``'s objectives (slo.py; 0: derived from the measurements).
    slo: SloConfig = SloConfig()
    # Price a handoff's KV on its path (``link_cost``): a thin link moves long prompts'
    # prefill to decode.
    link_aware: bool = True

    def __post_init__(self) -> None:
        if self.mode not in DISAGG_MODES:
            raise ValueError(f"unknown disagg mode {self.mode!r}; valid modes: "
                             f"{', '.join(DISAGG_MODES)}")
        for name in ("local_prefill_max_tokens", "local_prefill_max_queued_tokens",
                     "local_decode_max_running"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")


@dataclass(frozen=True)
class DisaggDecision:
    """Where the prompt is computed, and the rule that said so (a metric label and the
    ``x-pdserve-disagg`` response header)."""

    decision: Decision
    reason: Reason
    estimate: SloEstimate | None = None  # what an SLO decision weighed
    # What moving the prompt's KV to decode would have cost on its path (None: the
    # path is not measured, or the rules did not ask).
    transfer_s: float | None = None

    @property
    def remote(self) -> bool:
        return self.decision == "remote"

    def header(self) -> str:
        head = f"{self.decision}; reason={self.reason}"
        return head if self.transfer_s is None else f"{head}; kv_transfer_s={self.transfer_s:.4f}"


def choose_disagg(
    config: DisaggConfig, request: PlacementRequest, prefill: WorkerState | None,
    decode: WorkerState, decode_cached_tokens: int = 0,
) -> DisaggDecision:
    """Remote or local for one request, given the pair placement chose.

    ``prefill`` is None when placement found no healthy prefill worker compatible with
    ``decode``: then the prompt is computed on decode, whatever the mode. In ``slo``, the
    SLO rule decides (``slo.py``) once both engines have measured their steps.
    In ``auto``, and in ``slo`` until then (start-up), the first static rule that holds
    (``local tokens`` = the prompt tokens outside decode's own prefix cache,
    ``decode_cached_tokens``: what decode computes if local):

    - ``short_prompt``: the prompt has at most ``local_prefill_max_tokens`` tokens → local;
    - ``decode_cached``: the local tokens are that few (decode holds the rest), counting
      the local prompt tokens already sent to decode and not yet computed (their steps
      carry them too: on a busy decode, a burst of conversations' next turns would
      otherwise all be computed in its steps while the prefill worker idles) → local;
    - ``prefill_busy``: the prefill worker has more than
      ``local_prefill_max_queued_tokens`` uncached prompt tokens queued ahead of this
      request, decode runs at most ``local_decode_max_running`` requests, and the local
      tokens are no more than that queue threshold (a huge prompt would stall decode's
      streams longer than the queue delays this one) → local;
    - ``slow_link`` (``link_aware``): moving the local tokens' KV from prefill to decode
      over their path, at the rate decode measured its pulls from that peer at, would
      keep this stream waiting longer than computing them on decode keeps every stream
      there waiting: its measured per-token cost, times this request and each one
      decode runs (a local prefill shares decode's steps, so all of them stall for it;
      a handoff holds only its own stream) → local;
    - otherwise ``long_prompt`` → remote.

    The thresholds compare what *decode* would compute, not the prompt tokens outside
    the prefill worker's cache: a prompt whose prefix prefill holds is cheap remotely (a
    short prefill and a transfer) but is computed whole by a decode that lacks it, so
    prefill's cache argues for remote, never for local.
    """
    if prefill is None:
        return DisaggDecision("local", "no_prefill")
    if config.mode == "always":
        return DisaggDecision("remote", "always")
    if config.mode == "never":
        return DisaggDecision("local", "never")
    local_tokens = request.num_prompt_tokens - decode_cached_tokens
    if config.mode == "slo":
        moved = (transfer_s(prefill, decode, local_tokens) if config.link_aware else None)
        by_slo = choose_by_slo(config.slo, request, prefill, decode, decode_cached_tokens,
                               moved or 0.0)
        if by_slo is not None:
            return DisaggDecision(by_slo.decision, by_slo.reason, by_slo.estimate, moved)
    if request.num_prompt_tokens <= config.local_prefill_max_tokens:
        return DisaggDecision("local", "short_prompt")
    if decode_cached_tokens and (local_tokens + decode.num_assigned_tokens
                                 <= config.local_prefill_max_tokens):
        return DisaggDecision("local", "decode_cached")
    if _prefill_busy(config, local_tokens, prefill, decode):
        return DisaggDecision("local", "prefill_busy")
    moved = transfer_s(prefill, decode, local_tokens) if config.link_aware else None
    step = decode_step_cost(prefill, decode)
    if moved is not None and step is not None and (
            moved > compute_s(step, local_tokens) * (1 + num_running(decode))):
        return DisaggDecision("local", "slow_link", transfer_s=moved)
    return DisaggDecision("remote", "long_prompt", transfer_s=moved)


def _prefill_busy(config: DisaggConfig, local_tokens: int, prefill: WorkerState,
                  decode: WorkerState) -> bool:
    """The queue rule: prefill is backed up, decode has room, the prompt is moderate."""
    return (prefill.num_assigned_tokens > config.local_prefill_max_queued_tokens
            and num_running(decode) <= config.local_decode_max_running
            and local_tokens <= config.local_prefill_max_queued_tokens)


def num_running(worker: WorkerState) -> int:
    """Requests running or queued on the worker: this router's own count, or the
    engine's (which also sees other routers' requests), whichever is larger."""
    return max(worker.num_assigned, worker.load.num_running_reqs + worker.load.num_waiting_reqs)
