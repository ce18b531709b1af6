"""What a run cost, per million tokens: ``--cost-per-hour`` priced on what each system
used (its cores, or the node), as InferenceX prices a GPU-hour, and the honest variant
that charges only for the tokens of requests that met the SLOs.

For a run of ``d`` seconds on a system that costs ``h`` $/hour, the cost is
``h * d / 3600``; then

- ``usd_per_m_input`` / ``usd_per_m_output``: the cost over the run's completed input /
  output tokens, times a million (each as if the whole cost bought those tokens, as
  InferenceX reports $ per million input and output tokens);
- ``usd_per_m_tokens``: over input + output tokens;
- ``usd_per_m_tokens_in_slo``: over the input + output tokens of the requests that met
  both SLOs (TTFT and TPOT: the ones the report's goodput counts, derived from the
  baseline's unloaded run where there is one, else the run's own ``--slo``); None when
  no request met them.

A run's duration is the one its throughputs were counted over (completed requests /
request throughput). Pure functions over result JSONs: nothing here measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

UNITS = ("core", "node")


@dataclass(frozen=True)
class Price:
    """$ per hour of one ``unit``: a core the system's engines ran on, or the node."""

    usd_per_hour: float
    unit: str = "core"

    @classmethod
    def parse(cls, text: str) -> Price:
        """``0.05`` or ``0.05/core`` ($ per core-hour), ``2.4/node`` ($ per node-hour)."""
        amount, _, unit = text.strip().partition("/")
        unit = unit.strip() or "core"
        if unit not in UNITS:
            raise ValueError(f"--cost-per-hour {text!r}: the unit is one of {', '.join(UNITS)} "
                             "(compare runs its engines on this machine's cores)")
        try:
            value = float(amount)
        except ValueError:
            raise ValueError(f"--cost-per-hour {text!r}: {amount!r} is not a number") from None
        if not value > 0:
            raise ValueError(f"--cost-per-hour {text!r}: the price must be > 0")
        return cls(value, unit)

    def hourly(self, spec: dict[str, Any]) -> float | None:
        """What the system of ``spec`` (``SystemSpec.to_json()``) costs per hour; None
        for a per-core price where its cores are not known (a simulated system)."""
        if self.unit == "node":
            return self.usd_per_hour
        cores = cores_of(spec)
        return self.usd_per_hour * len(cores) if cores else None

    def to_json(self) -> dict[str, Any]:
        return {"usd_per_hour": self.usd_per_hour, "unit": self.unit}


def cores_of(spec: dict[str, Any]) -> set[int]:
    """The distinct cores a system's engines ran on (``cores``: role -> "0,1" or "2"; an
    entry that names none, a simulated system's "none", adds nothing)."""
    cores: set[int] = set()
    for listed in (spec.get("cores") or {}).values():
        cores.update(int(c) for c in str(listed).split(",") if c.strip().isdigit())
    return cores


def _met(request: dict[str, Any], slo: dict[str, Any]) -> bool:
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        limit = slo.get(key)
        if limit is not None and (request.get(key) is None or request[key] > limit):
            return False
    return True


def add_cost(result: dict[str, Any], usd_per_hour: float,
             slo: dict[str, Any] | None) -> None:
    """``result["cost"]`` for a run on a system of ``usd_per_hour``; ``slo``: the SLOs a
    request must meet to count in ``usd_per_m_tokens_in_slo`` (None or empty: every
    completed request counts)."""
    done = [r for r in result.get("requests", []) if not r.get("error")]
    throughput = result.get("request_throughput") or 0.0
    duration_s = len(done) / throughput if done and throughput else 0.0
    usd = usd_per_hour * duration_s / 3600.0
    num_in = sum(r.get("prompt_tokens", 0) for r in done)
    num_out = sum(r.get("output_tokens", 0) for r in done)
    good = [r for r in done if _met(r, slo or {})]
    num_good = sum(r.get("prompt_tokens", 0) + r.get("output_tokens", 0) for r in good)
    result["cost"] = {
        "usd_per_hour": usd_per_hour, "duration_s": duration_s, "usd": usd,
        "usd_per_m_input": _per_m(usd, num_in), "usd_per_m_output": _per_m(usd, num_out),
        "usd_per_m_tokens": _per_m(usd, num_in + num_out),
        "usd_per_m_tokens_in_slo": _per_m(usd, num_good), "tokens_in_slo": num_good,
    }


def _per_m(usd: float, tokens: int) -> float | None:
    return usd / tokens * 1e6 if tokens else None
