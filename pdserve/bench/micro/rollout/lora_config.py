"""``pdserve bench rollout-lora``'s settings (a frozen config; its field defaults are the
flags' defaults, ``pdserve/cli/bench_micro.py``). Nothing here imports torch or vLLM."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.lora import LORA_RANKS

# vLLM's /pause modes, in the order the bench runs them.
PAUSE_MODES = ("keep", "abort", "wait")
# The systems it runs the loop against, one after the other.
LORA_SYSTEMS = ("pdserve", "vllm")


@dataclass(frozen=True)
class RolloutLoraConfig:
    """Each system started in turn (``pdserve up`` and one aggregated ``vllm serve``, same
    model, dtype, cores and LoRA flags); on each, for each pause mode, ``refits`` rounds of
    a batch of ``batch`` prompts x ``n`` samples under adapter ``adapter_name`` while
    ``load`` streams run, then an adapter refit: ``/pause?mode=M``,
    ``/v1/load_lora_adapter`` (the next of ``adapters`` folders, ``load_inplace``),
    ``/resume``."""

    systems: tuple[str, ...] = LORA_SYSTEMS
    modes: tuple[str, ...] = PAUSE_MODES
    refits: int = 3  # per system and mode
    batch: int = 4  # prompts per round
    n: int = 2  # samples per prompt
    max_tokens: int = 32
    temperature: float = 1.0
    load: int = 2  # background streams, running through every refit
    load_max_tokens: int = 64
    adapters: int = 2  # the folders the refits cycle through (random, rank ``rank``)
    rank: int = 8
    adapter_name: str = "policy"
    clear_cache: bool = True  # /pause's clear_cache (vLLM's default)
    pause_timeout_s: float = 60.0  # /pause?timeout= (wait: pdserve honours it; vLLM has none)
    model_path: str | None = None  # default: the default model
    dtype: str = "auto"  # resolved once; both systems run the same
    kv_cache_gib: int = 2
    max_model_len: int = 1024
    deadline_s: float = 120.0  # one request or admin call unanswered this long fails it
    startup_timeout_s: float = 600.0
    seed: int = 0
    json: str | None = None

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in PAUSE_MODES]
        if not self.modes or bad:
            raise ValueError(f"--modes {','.join(self.modes)}: choose from "
                             f"{', '.join(PAUSE_MODES)}")
        bad = [s for s in self.systems if s not in LORA_SYSTEMS]
        if not self.systems or bad or len(set(self.systems)) != len(self.systems):
            raise ValueError(f"--systems {','.join(self.systems)}: choose from "
                             f"{', '.join(LORA_SYSTEMS)}, each once")
        if min(self.refits, self.batch, self.n, self.max_tokens, self.load_max_tokens,
               self.rank) < 1:
            raise ValueError("--refits, --batch, --n, --max-tokens, --load-max-tokens and "
                             "--rank must be >= 1")
        if self.load < 0 or self.adapters < 2:
            raise ValueError("--load must be >= 0 and --adapters >= 2 (a refit must change "
                             "the weights)")
        if self.n > 1 and self.temperature <= 0:
            raise ValueError("--n > 1 needs --temperature > 0 (greedy samples are equal)")
        if min(self.deadline_s, self.startup_timeout_s, self.pause_timeout_s) <= 0:
            raise ValueError("--deadline-s, --startup-timeout-s and --pause-timeout-s "
                             "must be > 0")
        if self.kv_cache_gib < 1 or self.max_model_len < 64:
            raise ValueError("--kv-cache-gib must be >= 1 and --max-model-len >= 64")
        if self.rank not in LORA_RANKS:
            raise ValueError(f"--rank {self.rank}: vLLM takes {', '.join(map(str, LORA_RANKS))}")
        if not self.adapter_name or "=" in self.adapter_name:
            raise ValueError("--adapter-name must be a non-empty name without '='")
