"""The planner's decision: how many workers should prefill and how many decode, from
the load the cluster measures itself. A pure function of a frozen state and inputs
(``plan``), with the clock passed in; ``router/cluster/planner_loop.py`` runs it and
flips roles.

Model (each term measured, never assumed):
- Demand over the last ``window_s`` (``Demand``): uncached prompt tokens arriving per
  second, split into *long* ones (a prompt whose prefill in one decode step would break
  the ITL objective: it belongs on a prefill worker) and *short* ones (prefilled on
  decode, cheaper than a handoff), and output tokens per second.
- Cost (``StepCost``): the engines' own step fit (base + per decoding sequence + per
  prompt token), the cluster's median.
- Prefill side: utilisation ``u_p = long tokens/s x per-token s / num_prefill``; it must
  stay below ``max_utilization`` or its queue, and TTFT, grow without bound.
- Decode side: a decode engine steps while anything decodes. With ``r`` output tokens/s
  and ``q`` prompt tokens/s of local prefill per engine, a share ``p = q x per-token s``
  of its time goes to prefill, and by Little's law its batch settles at ``b = r x
  step``, so the gap between tokens is ``base / (1 - u_d)`` with ``u_d = p + r x
  per-seq s``. The ITL objective holds while ``u_d <= 1 - base / itl``. With no prefill
  worker, long prompts are prefilled on decode too, and each stretches the steps it is
  in: that side's load is then at least the step carrying the longest one (a chunk of it,
  where the engines cap a request's prompt tokens per step) over the objective.
- A split *holds the SLOs* when both sides are within their limits and no long prompt
  is prefilled on decode. The best split holds them with the most headroom (the lowest
  of the two sides' utilisation over its limit: the highest throughput at the
  objectives); if none holds them, the lowest.

Hysteresis, so steady load never flaps: a better split must beat the current one's
bottleneck by ``min_gain`` (or hold the SLOs where the current does not) continuously
for ``hold_s`` before one worker is switched, and after a switch nothing moves for
``cooldown_s``. One worker moves per decision; the next decision may move another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Literal

from pdserve.router.dispatch.workers.state import StepCost

PLANNER_MODES = ("off", "on", "export")


@dataclass(frozen=True)
class PlannerConfig:
    """``mode`` off: fixed roles (the default); on: the planner flips roles; export: it
    decides and exports what it aims at, and an autoscaler acts (it flips nothing)."""

    mode: Literal["off", "on", "export"] = "off"
    interval_s: float = 5.0  # how often it samples and decides
    window_s: float = 60.0  # the demand it plans for: this much of the past
    hold_s: float = 20.0  # a better split must stay better this long
    cooldown_s: float = 60.0  # after a switch, no other for this long
    min_gain: float = 0.2  # ... by this fraction of the bottleneck utilisation
    max_utilization: float = 0.85  # above it a side's queue grows: its SLO breaks
    min_decode: int = 1
    drain_timeout_s: float = 30.0  # what a switch gives in-flight work
    # This router sees 1/demand_scale of the cluster's requests (its processes, or its
    # replicas behind a balancer, share them evenly): the demand it plans for is its own
    # times this. ``pdserve router --processes N`` multiplies it by N for process 0.
    demand_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.mode not in PLANNER_MODES:
            raise ValueError(f"unknown planner mode {self.mode!r}; valid modes: "
                             f"{', '.join(PLANNER_MODES)}")
        if min(self.interval_s, self.window_s) <= 0 or min(self.hold_s, self.cooldown_s) < 0:
            raise ValueError("planner interval and window must be > 0, hold and cooldown "
                             ">= 0")
        if not 0 <= self.min_gain < 1 or not 0 < self.max_utilization <= 1:
            raise ValueError("planner min_gain must be in [0, 1), max_utilization in (0, 1]")
        if self.min_decode < 1:
            raise ValueError("the planner keeps at least one decode worker")
        if not self.demand_scale >= 1:
            raise ValueError("planner demand_scale must be >= 1")

    @property
    def enabled(self) -> bool:
        """It runs (and, with etcd membership, this router is a candidate for it)."""
        return self.mode != "off"

    @property
    def switches_roles(self) -> bool:
        return self.mode == "on"


@dataclass(frozen=True)
class Demand:
    """The offered load over the window, per second (``planner_loop.DemandWindow``)."""

    long_tokens_per_s: float = 0.0  # uncached prompt tokens of prompts too long for decode
    short_tokens_per_s: float = 0.0  # the other prompts' uncached tokens
    output_tokens_per_s: float = 0.0
    max_long_tokens: int = 0  # the longest of those prompts

    @property
    def idle(self) -> bool:
        return not (self.long_tokens_per_s or self.short_tokens_per_s
                    or self.output_tokens_per_s)

    def scaled(self, factor: float) -> Demand:
        """The rates times ``factor`` (the longest prompt stays what it is)."""
        return Demand(self.long_tokens_per_s * factor, self.short_tokens_per_s * factor,
                      self.output_tokens_per_s * factor, self.max_long_tokens)


@dataclass(frozen=True)
class Split:
    num_prefill: int
    num_decode: int


@dataclass(frozen=True)
class SplitLoad:
    """One split's estimated utilisation per side, each over its limit (1: at the
    objective), and whether it holds the SLOs."""

    split: Split
    prefill: float
    decode: float
    holds_slos: bool

    @property
    def bottleneck(self) -> float:
        return max(self.prefill, self.decode)


def split_load(split: Split, demand: Demand, cost: StepCost, itl_s: float,
               max_utilization: float, chunk_tokens: int = 0) -> SplitLoad:
    """``chunk_tokens``: the decode engines' per-step prompt-token cap (0: none)."""
    if split.num_decode < 1:  # nothing decodes: no load it could hold
        return SplitLoad(split, math.inf, math.inf, holds_slos=False)
    long_tokens = demand.long_tokens_per_s
    local_tokens = demand.short_tokens_per_s + (0.0 if split.num_prefill else long_tokens)
    prefill = (long_tokens * cost.per_token_s / split.num_prefill if split.num_prefill
               else 0.0)
    decode = (local_tokens * cost.per_token_s
              + demand.output_tokens_per_s * cost.per_seq_s) / split.num_decode
    decode_limit = max(1.0 - cost.base_s / itl_s, 1e-3) if itl_s > 0 else 1.0
    decode /= min(decode_limit, max_utilization)
    if not split.num_prefill and long_tokens and itl_s > 0:
        # A long prompt's step on decode (at most a chunk of it, where decode engines cap
        # a request's prompt tokens per step): every stream there waits that long.
        step_tokens = min(demand.max_long_tokens, chunk_tokens or demand.max_long_tokens)
        decode = max(decode, cost.seconds(1, step_tokens) / itl_s)
    load = SplitLoad(split, prefill / max_utilization, decode, holds_slos=False)
    holds = load.bottleneck <= 1.0
    return replace(load, holds_slos=holds)


def best_split(num_workers: int, demand: Demand, cost: StepCost, itl_s: float,
               config: PlannerConfig, chunk_tokens: int = 0) -> SplitLoad:
    """The split of ``num_workers`` that holds the SLOs with the most headroom (else
    the lowest bottleneck); ties go to more decode workers."""
    loads = [split_load(Split(p, num_workers - p), demand, cost, itl_s,
                        config.max_utilization, chunk_tokens)
             for p in range(0, num_workers - config.min_decode + 1)]
    return min(loads, key=lambda s: (not s.holds_slos, round(s.bottleneck, 6),
                                     s.split.num_prefill))


@dataclass(frozen=True)
class PlannerState:
    """What the planner remembers between decisions (replaced, never changed)."""

    pending: Split | None = None  # the better split seen, and since when
    pending_since_s: float = 0.0
    last_switch_s: float | None = None


@dataclass(frozen=True)
class PlannerInputs:
    current: Split  # the healthy workers' roles now
    demand: Demand
    cost: StepCost | None  # None until an engine has measured its steps
    itl_s: float = 0.0  # the ITL objective (0: none)
    chunk_tokens: int = 0  # the decode engines' per-step prompt-token cap (0: none)


@dataclass(frozen=True)
class PlannerDecision:
    desired: Split  # what the planner aims at (exported for autoscalers)
    move: Literal["to_prefill", "to_decode"] | None  # switch one worker now, or nothing
    reason: str
    current_load: SplitLoad | None = None
    desired_load: SplitLoad | None = None


def plan(config: PlannerConfig, state: PlannerState, inputs: PlannerInputs, now_s: float
         ) -> tuple[PlannerDecision, PlannerState]:
    """The next decision and state (module docstring)."""
    current = inputs.current
    total = current.num_prefill + current.num_decode
    if inputs.cost is None or inputs.demand.idle or total <= config.min_decode:
        why = ("no step measured yet" if inputs.cost is None
               else "no load" if inputs.demand.idle else "too few workers to split")
        return PlannerDecision(current, None, why), replace(state, pending=None)
    now_load = split_load(current, inputs.demand, inputs.cost, inputs.itl_s,
                          config.max_utilization, inputs.chunk_tokens)
    best = best_split(total, inputs.demand, inputs.cost, inputs.itl_s, config,
                      inputs.chunk_tokens)
    # A better split must win by ``min_gain`` in every case: restoring the SLOs too
    # (it must then hold them with that much headroom), or noise near a boundary flips
    # the roles back and forth.
    better = best.split != current and (
        (best.holds_slos and not now_load.holds_slos
         and best.bottleneck <= 1 - config.min_gain)
        or best.bottleneck < now_load.bottleneck * (1 - config.min_gain))
    if not better:
        return (PlannerDecision(current, None, "current split is best", now_load, now_load),
                replace(state, pending=None))
    if state.pending != best.split:
        state = replace(state, pending=best.split, pending_since_s=now_s)
    held = now_s - state.pending_since_s >= config.hold_s
    cooled = state.last_switch_s is None or now_s - state.last_switch_s >= config.cooldown_s
    if not (held and cooled):
        why = "holding" if not held else "cooling down"
        return PlannerDecision(best.split, None, why, now_load, best), state
    move: Literal["to_prefill", "to_decode"] = (
        "to_prefill" if best.split.num_prefill > current.num_prefill else "to_decode")
    return (PlannerDecision(best.split, move, "better split held", now_load, best),
            replace(state, pending=None, last_switch_s=now_s))


def median_cost(costs: Sequence[StepCost]) -> StepCost | None:
    """The cluster's step cost: each term's median over the engines that measured it
    (a decode term from decode steps, the per-token term from prompt steps)."""
    decode = sorted(costs, key=lambda c: c.base_s + c.per_seq_s)
    decode = [c for c in decode if c.decode_measured] or decode
    prompt = sorted((c for c in costs if c.prefill_measured), key=lambda c: c.per_token_s)
    if not decode or not prompt:
        return None
    d, p = decode[len(decode) // 2], prompt[len(prompt) // 2]
    return StepCost(d.base_s, d.per_seq_s, p.per_token_s, True, True)
