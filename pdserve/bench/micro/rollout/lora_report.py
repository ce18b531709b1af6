"""``pdserve bench rollout-lora``'s accounting, apart from any network: what each response
cost an RL client (tokens it must throw away and generate again), what a refit took, and
the per-mode table of both systems with pdserve / vLLM ratios.

A response's choice is *cut* when its ``finish_reason`` is ``abort`` or it ended without
one: an RL client cannot use a partial sample, so its tokens are *lost*, and the loop
sends the request again (*regenerated* tokens: that retry's). A response is
*attributable* when its ``usage.weight_versions`` spans cover every token of every
choice (pdserve's per-token versions; vLLM reports none); one that crossed a refit is
*named* when its spans name both adapter folders (``lora``: where it switched).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

CUT_REASONS = ("abort", None)


class LoraCheckError(RuntimeError):
    """A failed request or admin call: the numbers of that system and mode would lie."""


@dataclass
class Sample:
    """One streamed response as the client saw it (``kind``: batch, load, regen or
    probe): per choice index its tokens and ``finish_reason``; its usage spans."""

    kind: str
    started_s: float
    n: int = 1  # choices asked for: one never seen is cut too
    ended_s: float = math.nan
    first_token_s: float = math.nan
    status: int = 0
    error: str = ""
    tokens: dict[int, int] = field(default_factory=dict)
    finish: dict[int, str | None] = field(default_factory=dict)
    spans: list[dict[str, Any]] | None = None
    fingerprints: set[str] = field(default_factory=set)  # its chunks' system_fingerprint

    @property
    def failed(self) -> bool:
        return self.status != 200 or bool(self.error)

    def cut(self) -> list[int]:
        """The choices an RL client must regenerate."""
        indexes = set(range(self.n)) | self.tokens.keys() | self.finish.keys()
        return [i for i in sorted(indexes) if self.finish.get(i) in CUT_REASONS]

    @property
    def lost_tokens(self) -> int:
        return sum(self.tokens.get(i, 0) for i in self.cut())

    @property
    def num_tokens(self) -> int:
        return sum(self.tokens.values())

    def names_switch(self) -> bool:
        """Its spans name two adapter folders or more (a kept request's switch)."""
        return len({s.get("lora") for s in self.spans or () if s.get("lora")}) > 1

    def attributable(self) -> bool:
        """Every choice's tokens covered, from 0 with no gap, by its version spans."""
        if self.spans is None:
            return False
        for index, count in self.tokens.items():
            own = sorted((int(s["start"]), int(s["end"])) for s in self.spans
                         if int(s.get("index", 0)) == index)
            at = 0
            for start, end in own:
                if start != at or end < start:
                    return False
                at = end
            if at != count:
                return False
        return True


def check_sample(sample: Sample) -> None:
    if sample.failed:
        raise LoraCheckError(f"a {sample.kind} request: HTTP {sample.status} {sample.error}")


@dataclass(frozen=True)
class RefitTiming:
    """One refit: ``/pause`` sent, answered; the load answered; ``/resume`` answered;
    the first token of a probe under the adapter sent after it."""

    pause_call_s: float
    paused_s: float
    loaded_s: float
    resumed_s: float
    probe_first_s: float

    @property
    def latency_s(self) -> float:
        return self.resumed_s - self.pause_call_s

    @property
    def to_token_s(self) -> float:
        return self.probe_first_s - self.pause_call_s

    def crossed_by(self, sample: Sample) -> bool:
        """``sample`` ran through the whole refit: sent before ``/pause``, ended after
        ``/resume`` answered (uncut, under ``keep``: tokens of both folders, unless the
        server says otherwise)."""
        return sample.started_s < self.pause_call_s and sample.ended_s > self.resumed_s


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


@dataclass
class ModeResult:
    """One system's loop under one pause mode."""

    system: str
    mode: str
    wall_s: float = 0.0
    refits: list[RefitTiming] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    error: str = ""  # the check that ended this loop early

    def summary(self) -> dict[str, Any]:
        answered = [s for s in self.samples if not s.failed and s.kind != "probe"]
        crossed = [s for s in answered if not s.cut() and
                   any(r.crossed_by(s) for r in self.refits)]
        refits = len(self.refits)
        per = refits or 1
        return {
            "refits": refits,
            "refits_per_min": refits / self.wall_s * 60 if self.wall_s > 0 else None,
            "refit_latency_s": _median([r.latency_s for r in self.refits]),
            "pause_s": _median([r.paused_s - r.pause_call_s for r in self.refits]),
            "load_s": _median([r.loaded_s - r.paused_s for r in self.refits]),
            "refit_to_token_s": _median([r.to_token_s for r in self.refits]),
            "requests": len(answered),
            "requests_cut": sum(1 for s in answered if s.cut()),
            "requests_failed": sum(1 for s in self.samples if s.failed),
            "tokens": sum(s.num_tokens for s in answered),
            "tokens_lost_per_refit": sum(s.lost_tokens for s in answered) / per,
            "tokens_regenerated_per_refit":
                sum(s.num_tokens for s in answered if s.kind == "regen") / per,
            "crossed_refit": len(crossed),
            "crossed_named": sum(1 for s in crossed if s.names_switch()),
            "attributable": (sum(1 for s in answered if s.attributable()) / len(answered)
                             if answered else None),
            # what the responses' fingerprints said produced them (pdserve: the base
            # weights' version; vLLM: a hash of its config made at start): neither names
            # the adapter folder (pdserve's spans do: ``crossed_named``)
            "fingerprints": sorted(set().union(*(s.fingerprints for s in answered))),
            "error": self.error,
        }

    def to_json(self) -> dict[str, Any]:
        return {"system": self.system, "mode": self.mode, "wall_s": self.wall_s,
                "summary": self.summary(),
                "refits": [{"latency_s": r.latency_s, "to_token_s": r.to_token_s,
                            "pause_s": r.paused_s - r.pause_call_s,
                            "load_s": r.loaded_s - r.paused_s} for r in self.refits]}


# (summary key, column title, format); the table's rows per mode.
COLUMNS = (("refits_per_min", "refits/min", ".2f"), ("refit_latency_s", "pause→resume s", ".2f"),
           ("refit_to_token_s", "pause→probe token s", ".2f"),
           ("tokens_lost_per_refit", "tokens lost/refit", ".1f"),
           ("tokens_regenerated_per_refit", "regenerated/refit", ".1f"),
           ("requests_cut", "requests cut", "d"), ("requests_failed", "failed", "d"),
           ("crossed_refit", "crossed a refit", "d"),
           ("crossed_named", "…saying where", "d"), ("attributable", "attributable", ".0%"))


def ratio(ours: Any, theirs: Any) -> float | None:
    """pdserve / vLLM, where both are numbers and vLLM's is not 0."""
    if isinstance(ours, int | float) and isinstance(theirs, int | float) and theirs:
        return float(ours) / float(theirs)
    return None


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    return format(int(value), fmt) if fmt == "d" else format(float(value), fmt)


def print_modes(results: Sequence[ModeResult], console: Console) -> None:
    """One table per mode: a row per system, and pdserve / vLLM."""
    by = {(r.system, r.mode): r.summary() for r in results}
    for mode in dict.fromkeys(r.mode for r in results):
        table = Table(title=f"pdserve bench rollout-lora: /pause?mode={mode}")
        table.add_column("system")
        for _, title, _ in COLUMNS:
            table.add_column(title, justify="right")
        rows = {system: s for (system, m), s in by.items() if m == mode}
        for system, s in rows.items():
            table.add_row(system + (" (FAILED)" if s["error"] else ""),
                          *(_fmt(s[k], f) for k, _, f in COLUMNS))
        if "pdserve" in rows and "vllm" in rows:
            table.add_row("pdserve / vLLM", *(_fmt(ratio(rows["pdserve"][k], rows["vllm"][k]),
                                                   ".2f") for k, _, _ in COLUMNS))
        console.print(table)
        for system, s in rows.items():
            if s["error"]:
                console.print(f"[red]{system}, mode {mode}: {s['error']}[/]")
