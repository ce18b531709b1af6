"""What ``pdserve bench run`` and ``sweep`` are given: frozen configs, built by the CLI
(``pdserve bench``'s flags) or by any caller; nothing here parses flags.

Field names and order are the flags' (``--base-url`` -> ``base_url``): a result's
``config`` records them as given."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_MIX = "0.7:80:96,0.3:1200:16"


@dataclass(frozen=True)
class RunConfig:
    """One workload against one endpoint (``pdserve bench run``)."""

    # endpoint
    base_url: str
    model: str | None = None  # default: the server's first
    endpoint: str = "chat"  # "chat" | "completions"
    api_key: str | None = None
    tokenizer: str | None = None
    max_model_len: int | None = None
    request_timeout_s: float = 600.0
    ignore_eos: bool | None = None  # default: on for synthetic workloads
    # workload
    workload: str = "random"
    input_len: int = 256
    output_len: int | None = None
    range_ratio: float = 0.0
    mix: str = DEFAULT_MIX
    mix_then: str | None = None
    mix_shift_at: int | None = None
    num_system_prompts: int = 2
    system_prompt_len: int = 512
    num_users: int = 4
    num_turns: int = 3
    turn_input_len: int = 64
    dataset: str | None = None
    trace_block_tokens: int = 512  # mooncake-trace: tokens per hash_id (the trace's: 512)
    trace_time_scale: float = 1.0  # mooncake-trace: arrival times multiplied by this
    trace_start: int = 0  # mooncake-trace: the first record replayed
    # traffic
    num_requests: int | None = None  # default 100 unless duration_s
    duration_s: float | None = None
    num_warmup: int = 1
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    # output
    slo: str | None = None
    result_json: str | None = None
    no_progress: bool = False

    def recorded(self) -> dict[str, Any]:
        """The config as a result records it (the command, then every field)."""
        return {"subcommand": "run", **asdict(self)}


@dataclass(frozen=True)
class SweepConfig:
    """``run`` at several rates (``request_rates``) or concurrencies
    (``max_concurrencies``), comma-separated, exactly one of them set."""

    run: RunConfig
    request_rates: str | None = None
    max_concurrencies: str | None = None
    goodput_share: float = 0.9

    def recorded(self) -> dict[str, Any]:
        return {"subcommand": "sweep", **asdict(self.run), "request_rates": self.request_rates,
                "max_concurrencies": self.max_concurrencies,
                "goodput_share": self.goodput_share}


def parse_list(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad {flag} {text!r}: expected comma-separated numbers") from None
    if not values or any(not v > 0 for v in values):
        raise ValueError(f"bad {flag} {text!r}: expected numbers > 0")
    return values
