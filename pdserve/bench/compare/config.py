"""``pdserve bench compare``'s config and the checks that build it: every check that can
fail (bad rates, a ``--pdserve`` entry ``pdserve up`` refuses, a missing model, a
non-empty output folder) runs before any system starts. The CLI
(``pdserve bench compare``) reads the flags and calls these."""

from __future__ import annotations

import importlib.util
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.compare.cost import Price
from pdserve.bench.compare.external import ExternalVllm
from pdserve.bench.compare.systems import EngineSettings, parse_pdserve_entry, pdserve_command
from pdserve.core.dtype import DtypeChoice, resolve_dtype
from pdserve.core.model import resolve_model

DEFAULT_RATES = "0.5,1,1.5"


@dataclass(frozen=True)
class CompareConfig:
    settings: EngineSettings
    rates: tuple[float, ...]
    pdserve: tuple[tuple[str, str], ...]  # (name, pdserve up flags)
    with_vllm: bool
    with_vllm_disagg: bool
    workload_args: tuple[str, ...]  # for every bench run
    seed: int
    slo: str | None
    output_dir: Path
    startup_timeout_s: float
    run_timeout_s: float
    stop_timeout_s: float
    dtype: DtypeChoice  # how settings.dtype was chosen (printed, and in the report)
    with_vllm_stock: bool = True  # stock vllm serve beside the tuned baseline
    cost: Price | None = None  # --cost-per-hour: what each system's runs cost
    # --vllm-url: the running vLLM server that is the baseline in place of vllm-tuned
    vllm_external: ExternalVllm | None = None
    # How to run pdserve itself (`pdserve up`, `pdserve bench run`).
    pdserve_command: tuple[str, ...] = field(default_factory=pdserve_command)


def parse_rates(text: str) -> tuple[float, ...]:
    rates = []
    for part in (p.strip() for p in text.split(",")):
        try:
            rate = float(part)
        except ValueError:
            raise ValueError(f"--request-rates: {part!r} is not a number or 'inf'") from None
        if not rate > 0 or math.isnan(rate):
            raise ValueError(f"--request-rates: {part!r} must be > 0")
        rates.append(rate)
    if len(set(rates)) != len(rates):
        raise ValueError("--request-rates: a rate is given twice")
    return tuple(rates)


def check_trace_rates(workload: str | None, time_scale: float | None,
                      rates: tuple[float, ...]) -> None:
    """A trace replay scales its times to each finite rate, or by ``--trace-time-scale``
    at rate ``inf``: not both."""
    if (workload == "mooncake-trace" and time_scale not in (None, 1.0)
            and any(not math.isinf(r) for r in rates)):
        raise ValueError("--workload mooncake-trace: --trace-time-scale needs "
                         "--request-rates inf (finite rates scale the trace's times "
                         "themselves)")


def check_timeouts(startup_timeout_s: float, run_timeout_s: float,
                   stop_timeout_s: float) -> None:
    if min(startup_timeout_s, run_timeout_s, stop_timeout_s) <= 0:
        raise ValueError("--startup-timeout-s, --run-timeout-s and --stop-timeout-s must "
                         "be > 0")


def pdserve_entries(given: Sequence[str] | None, reserved: tuple[str, ...],
                    check_up_flags: Callable[[str, str], None] | None = None
                    ) -> tuple[tuple[str, str], ...]:
    """``--pdserve NAME=FLAGS`` entries (default: one named ``default`` with no flags);
    names unique and not ``reserved``; each entry's flags checked by ``check_up_flags``
    (name, flags), which raises ``ValueError`` for flags ``pdserve up`` refuses (the
    CLI passes one that parses them with ``pdserve up``'s own parser)."""
    entries = [parse_pdserve_entry(e) for e in (given or ["default="])]
    names = [n for n, _ in entries] + list(reserved)
    if len(set(names)) != len(names):
        raise ValueError("--pdserve names must differ from each other and from "
                         + ", ".join(f"'{n}'" for n in reserved))
    if check_up_flags is not None:
        for name, flags in entries:
            check_up_flags(name, flags)
    return tuple(entries)


def output_dir(given: Path | None, kind: str) -> Path:
    """``given``, or ``bench/results/<kind>-<time>``; refused unless absent or empty."""
    out = given or Path("bench/results") / time.strftime(f"{kind}-%Y%m%d-%H%M%S")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--output-dir {out}: exists and is not an empty folder")
    return out


def engine_settings(model: str | None = None, dtype: str = "auto", kv_cache_gib: int = 2,
                    max_model_len: int = 4096, num_kv_blocks: int | None = None
                    ) -> tuple[EngineSettings, DtypeChoice]:
    """What every system's engines share (the model, the dtype resolved once, the KV
    cache per engine, the context length, this process's cores), and how the dtype was
    chosen. The defaults are the flags' (``--model`` etc.)."""
    resolved = resolve_model(model)
    choice = resolve_dtype(dtype, model_path=resolved.path)
    settings = EngineSettings(str(resolved.path), resolved.served_name, choice.dtype,
                              kv_cache_gib, max_model_len, tuple(sorted(_affinity())),
                              num_kv_blocks=num_kv_blocks)
    return settings, choice


def _affinity() -> set[int]:
    return os.sched_getaffinity(0)


def check_vllm_disagg() -> None:
    """vLLM's NixlConnector imports ``nixl``; on CPU the ``nixl-cu12`` wheel serves
    (pdserve's vLLM plugin maps ``nixl`` onto it when the meta package is missing)."""
    if not any(importlib.util.find_spec(m) for m in ("nixl", "nixl_cu12", "nixl_cu13")):
        raise ValueError("--with-vllm-disagg needs NIXL for vLLM's NixlConnector: "
                         "pip install 'pdserve[bench]'")
    if len(_affinity()) < 2:
        raise ValueError("--with-vllm-disagg needs 2+ cores (prefill and decode engines on "
                         "separate cores)")
