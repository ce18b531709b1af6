"""One run's numbers from its request records, with ``vllm bench serve``'s definitions.

- TTFT: request sent to the first streamed chunk with a choice.
- ITL: time between consecutive chunks with a choice (a chunk may hold several tokens).
- E2E: request sent to the last chunk with a choice (the usage chunk does not count).
- TPOT: ``(e2e - ttft) / (output_tokens - 1)``: excludes the first token; only requests
  with more than one output token enter its statistics; for goodput a request with one
  token has TPOT 0.
- Goodput: completed requests whose every given SLO holds (``value <= slo``, the edge
  included), per second of the run; throughputs count completed requests only.
- Percentiles: ``numpy.percentile`` (linear interpolation).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

PERCENTILES = (50, 90, 99)
SLO_NAMES = ("ttft", "tpot", "e2e")
_SLO_ITEM = re.compile(r"^\s*(\w+)\s*=\s*([0-9]*\.?[0-9]+)\s*(ms|s)\s*$")


@dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; ``start_s`` from the run's start."""

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    itls_s: list[float] = field(default_factory=list)
    start_s: float = 0.0
    error: str | None = None  # an error kind; None: completed

    @property
    def tpot_s(self) -> float | None:
        if self.error is not None or self.ttft_s is None or self.e2e_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0  # as vLLM: no TPOT, counts as 0 for goodput
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["tpot_s"] = self.tpot_s
        return out


@dataclass(frozen=True)
class Slo:
    """Service-level objectives in seconds; None: not set."""

    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> Slo:
        """``"ttft=2s,tpot=100ms,e2e=30s"`` (any subset; units s or ms)."""
        if not text:
            return cls()
        values: dict[str, float] = {}
        for item in text.split(","):
            match = _SLO_ITEM.match(item)
            if match is None or match.group(1) not in SLO_NAMES:
                raise ValueError(f"bad --slo item {item.strip()!r} in {text!r}: expected "
                                 f"NAME=VALUE(s|ms), NAME one of {', '.join(SLO_NAMES)}, "
                                 "e.g. ttft=2s,tpot=100ms")
            name, value, unit = match.groups()
            if name in values:
                raise ValueError(f"bad --slo {text!r}: {name} given twice")
            values[name] = float(value) / (1000 if unit == "ms" else 1)
        return cls(**{f"{k}_s": v for k, v in values.items()})

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in (self.ttft_s, self.tpot_s, self.e2e_s))

    def met_by(self, record: RequestRecord) -> bool:
        if record.error is not None:
            return False
        pairs = ((self.ttft_s, record.ttft_s), (self.tpot_s, record.tpot_s),
                 (self.e2e_s, record.e2e_s))
        return all(slo is None or (value is not None and value <= slo) for slo, value in pairs)

    def to_json(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "tpot_s": self.tpot_s, "e2e_s": self.e2e_s}


def stats(values: list[float]) -> dict[str, float | None]:
    """Mean and percentiles; every value None when there is no sample."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES)]
    if not values:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    return dict(zip(keys, [float(arr.mean()),
                           *(float(np.percentile(arr, p)) for p in PERCENTILES)], strict=True))


def summarize(records: list[RequestRecord], duration_s: float, slo: Slo) -> dict[str, Any]:
    """The result's metric fields (``schema pdserve.bench.run/v1``) for ``records``."""
    done = [r for r in records if r.error is None]
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    num_in = sum(r.prompt_tokens for r in done)
    num_out = sum(r.output_tokens for r in done)
    num_cached = sum(r.cached_tokens for r in done)
    num_good = sum(slo.met_by(r) for r in done)
    dur = max(duration_s, 1e-9)
    return {
        "completed": len(done), "failed": len(records) - len(done), "errors": errors,
        "input_tokens": num_in, "output_tokens": num_out, "cached_tokens": num_cached,
        "cached_token_share": num_cached / num_in if num_in else 0.0,
        "request_throughput": len(done) / dur, "output_throughput": num_out / dur,
        "total_token_throughput": (num_in + num_out) / dur,
        "slo": slo.to_json(), "good": num_good, "goodput": num_good / dur,
        "goodput_share": num_good / len(done) if done else 0.0,
        "ttft_s": stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": stats([r.tpot_s for r in done if r.output_tokens > 1 and r.tpot_s is not None]),
        "itl_s": stats([x for r in done for x in r.itls_s]),
        "e2e_s": stats([r.e2e_s for r in done if r.e2e_s is not None]),
    }
