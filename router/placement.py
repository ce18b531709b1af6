"""Placement policies: pure functions from worker snapshots to a choice.

A policy reads ``WorkerState`` snapshots and returns indices; it never routes
or mutates. Its only state (a round-robin cursor) changes through ``advance``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .workers import WorkerState


@dataclass(frozen=True)
class Choice:
    prefill: int | None  # index into the prefill list; None = no prefill (aggregated fallback)
    decode: int


class Placement(Protocol):
    name: str

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int
    ) -> Choice | None:
        """A (prefill, decode) pair among healthy, compatible workers, or None."""
        ...


def _pairs(prefill: Sequence[WorkerState], decode: Sequence[WorkerState]) -> tuple[
        list[int], list[int]]:
    p = [i for i, w in enumerate(prefill) if w.healthy]
    d = [i for i, w in enumerate(decode) if w.healthy]
    return p, d


def _compatible(prefill: WorkerState, decode: WorkerState) -> bool:
    return prefill.compatibility_hash == decode.compatibility_hash


class RoundRobinPlacement:
    name = "round_robin"

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int
    ) -> Choice | None:
        p, d = _pairs(prefill, decode)
        if not d:
            return None
        di = d[cursor % len(d)]
        compatible = [i for i in p if _compatible(prefill[i], decode[di])]
        pi = compatible[cursor % len(compatible)] if compatible else None
        return Choice(pi, di)


def _load(w: WorkerState) -> tuple[float, float]:
    busy = w.num_assigned + w.load.num_waiting_reqs
    return (busy, w.load.kv_cache_usage)


class LeastLoadedPlacement:
    name = "least_loaded"

    def choose(
        self, prefill: Sequence[WorkerState], decode: Sequence[WorkerState], cursor: int
    ) -> Choice | None:
        p, d = _pairs(prefill, decode)
        if not d:
            return None
        di = min(d, key=lambda i: (_load(decode[i]), (i - cursor) % len(decode)))
        compatible = [i for i in p if _compatible(prefill[i], decode[di])]
        if not compatible:
            return Choice(None, di)
        pi = min(compatible, key=lambda i: (_load(prefill[i]), (i - cursor) % len(prefill)))
        return Choice(pi, di)


PLACEMENTS: dict[str, type[RoundRobinPlacement] | type[LeastLoadedPlacement]] = {
    "round_robin": RoundRobinPlacement,
    "least_loaded": LeastLoadedPlacement,
}


def create_placement(name: str) -> Placement:
    try:
        return PLACEMENTS[name]()
    except KeyError:
        raise ValueError(
            f"unknown placement {name!r}; valid placements: {', '.join(sorted(PLACEMENTS))}"
        ) from None
