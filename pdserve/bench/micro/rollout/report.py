"""The rollout bench's accounting, apart from any network: which weight version each
response may carry, tokens per window around a refit, and the per-round report.

Times are ``time.monotonic()`` seconds. A refit is a ``RefitSpan``: the admin call's
start, its return, and the first token of a probe request on the new weights. A window
of the background load's throughput is ``before`` the refit if it ends by the call's
start, ``after`` if it starts at or after the probe's first token, else ``during``; the
dip is how far the slowest ``during`` window falls below the ``before`` mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

PHASES = ("before", "during", "after")


class RolloutCheckError(RuntimeError):
    """A response or answer that would make the bench's numbers lies: a non-200, a
    version other than the one expected, a response mixed from two versions."""


@dataclass(frozen=True)
class RefitSpan:
    call_s: float  # the update call sent
    returned_s: float  # its 200 read
    first_token_s: float  # the probe's first token on the new weights

    @property
    def end_to_end_s(self) -> float:
        return self.first_token_s - self.call_s


@dataclass
class StreamRecord:
    """One streamed response as the client saw it: when it started and ended, the
    version its header named, the versions its chunks named, and its tokens as
    ``(arrival, count)`` events."""

    started_s: float
    status: int = 0
    header_version: str | None = None
    chunk_versions: set[str] = field(default_factory=set)
    events: list[tuple[float, int]] = field(default_factory=list)
    ended_s: float = math.nan
    error: str = ""

    @property
    def first_token_s(self) -> float:
        return self.events[0][0] if self.events else math.nan

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.events)


def check_stream(record: StreamRecord, allowed: Iterable[str]) -> str:
    """The one version ``record`` was produced by; raises ``RolloutCheckError`` if it
    failed, mixes versions, its header disagrees with its chunks, or the version is not
    one of ``allowed``."""
    allowed = tuple(allowed)
    if record.status != 200 or record.error:
        raise RolloutCheckError(f"a stream answered HTTP {record.status} {record.error}")
    if len(record.chunk_versions) != 1:
        raise RolloutCheckError("a stream's chunks named versions "
                                f"{sorted(record.chunk_versions)}: one expected")
    (version,) = record.chunk_versions
    if record.header_version != version:
        raise RolloutCheckError(f"a stream's x-weight-version {record.header_version!r} is "
                                f"not its chunks' system_fingerprint {version!r}")
    if version not in allowed:
        raise RolloutCheckError(f"a stream came from version {version!r}; expected "
                                f"{' or '.join(map(repr, allowed))}")
    return version


def expected_versions(record: StreamRecord, span: RefitSpan, old: str,
                      new: str) -> tuple[str, ...]:
    """The versions ``record`` may carry given when it ran: a stream that ended before
    the call was on ``old``; one that started after the call returned, on ``new``."""
    if record.ended_s <= span.call_s:
        return (old,)
    if record.started_s >= span.returned_s:
        return (new,)
    return (old, new)


def check_load(records: Sequence[StreamRecord], span: RefitSpan, old: str,
               new: str) -> dict[str, int]:
    """Every background stream checked against its timing; how many each version
    served (raises ``RolloutCheckError`` at the first that is wrong)."""
    counts = {old: 0, new: 0}
    for record in records:
        counts[check_stream(record, expected_versions(record, span, old, new))] += 1
    return counts


def window_rates(events: Iterable[tuple[float, int]], start_s: float, end_s: float,
                 width_s: float) -> list[float]:
    """Tokens/s in each whole window of ``width_s`` from ``start_s`` until ``end_s``
    (a partial last window is left out: its rate would read low)."""
    num = int((end_s - start_s) / width_s + 1e-9)
    counts = [0] * num
    for at, tokens in events:
        index = math.floor((at - start_s) / width_s)
        if 0 <= index < num:
            counts[index] += tokens
    return [c / width_s for c in counts]


def phase(window_start_s: float, width_s: float, span: RefitSpan) -> str:
    if window_start_s + width_s <= span.call_s:
        return "before"
    return "after" if window_start_s >= span.first_token_s else "during"


@dataclass(frozen=True)
class Timeline:
    """The background load's tokens/s per window around one refit."""

    width_s: float
    start_s: float  # the first window's start, relative to the refit call
    rates: tuple[float, ...]
    phases: tuple[str, ...]

    @classmethod
    def of(cls, records: Iterable[StreamRecord], start_s: float, end_s: float,
           width_s: float, span: RefitSpan) -> Timeline:
        events = [e for r in records for e in r.events]
        rates = window_rates(events, start_s, end_s, width_s)
        phases = [phase(start_s + i * width_s, width_s, span) for i in range(len(rates))]
        return cls(width_s, start_s - span.call_s, tuple(rates), tuple(phases))

    def _rates(self, which: str) -> list[float]:
        return [r for r, p in zip(self.rates, self.phases, strict=True) if p == which]

    def summary(self) -> dict[str, float | None]:
        """Mean tokens/s per phase, the slowest ``during`` window, the dip (1 - that
        over the ``before`` mean) and the longest run of windows without a token."""
        means = {p: _mean(self._rates(p)) for p in PHASES}
        during = self._rates("during")
        low = min(during) if during else None
        before = means["before"]
        dip = None if low is None or not before else 1 - low / before
        return {**{f"{p}_tok_s": m for p, m in means.items()}, "during_min_tok_s": low,
                "dip": dip, "longest_stall_s": self._longest_stall()}

    def _longest_stall(self) -> float:
        longest = run = 0
        for rate in self.rates:
            run = run + 1 if rate == 0 else 0
            longest = max(longest, run)
        return longest * self.width_s


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


@dataclass
class RoundResult:
    """One round: its batch on ``batch_version``, then the refit to ``version``."""

    round: int
    batch_version: str
    version: str
    model_path: str
    batch_prompts: int
    batch_samples: int
    batch_tokens: int
    batch_s: float
    refit_call_s: float  # the admin call, as the client timed it
    refit_server_s: float  # its answer's "seconds"
    refit_stage_s: float | None  # its answer's "stage_seconds" (pdserve's), if any
    refit_e2e_s: float  # call to the probe's first token on the new weights
    load_versions: dict[str, int] = field(default_factory=dict)
    timeline: Timeline | None = None

    @property
    def batch_tok_s(self) -> float:
        return self.batch_tokens / self.batch_s if self.batch_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["batch_tok_s"] = self.batch_tok_s
        out["timeline_summary"] = self.timeline.summary() if self.timeline else None
        return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def print_rounds(rounds: Sequence[RoundResult], console: Console) -> None:
    table = Table(title="pdserve bench rollout: per round")
    for col in ("round", "batch on", "samples", "batch tok/s", "refit to", "call s",
                "call→token s", "load tok/s before/during/after", "dip", "stall s"):
        table.add_column(col, justify="right")
    for r in rounds:
        s = r.timeline.summary() if r.timeline else {}
        table.add_row(str(r.round), r.batch_version, str(r.batch_samples),
                      f"{r.batch_tok_s:.1f}", r.version, f"{r.refit_call_s:.2f}",
                      f"{r.refit_e2e_s:.2f}",
                      "/".join(_num(s.get(f"{p}_tok_s"), ".0f") for p in PHASES),
                      _num(s.get("dip"), ".0%"), _num(s.get("longest_stall_s"), ".1f"))
    console.print(table)


def summarize(rounds: Sequence[RoundResult]) -> dict[str, float | None]:
    """Medians over the rounds: batch tokens/s, refit end to end, the dip."""
    dips = [d for r in rounds if r.timeline and (d := r.timeline.summary()["dip"]) is not None]
    return {"batch_tok_s_median": statistics.median(r.batch_tok_s for r in rounds),
            "refit_e2e_s_median": statistics.median(r.refit_e2e_s for r in rounds),
            "refit_e2e_s_max": max(r.refit_e2e_s for r in rounds),
            "dip_median": statistics.median(dips) if dips else None}
