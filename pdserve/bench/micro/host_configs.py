"""The configs of the benches whose cluster runs on hosts (network namespaces, shaped
links: ``pdserve.bench.hosts``): ``pdserve bench partitions`` and ``pdserve bench
link-aware``. Apart from the benches, as ``configs.py``, so that building them imports
neither torch nor vLLM."""

from __future__ import annotations

from dataclasses import dataclass

PARTITIONS = ("router-decode", "prefill-decode", "prefill-router", "worker-etcd", "router-etcd",
              "frozen-decode")


@dataclass(frozen=True)
class PartitionsConfig:
    """``pdserve bench partitions`` (``partitions.py``)."""

    faults: str = ",".join(PARTITIONS)  # comma-separated, in turn each repetition
    reps: int = 3
    streams: int = 3  # at once, through each fault
    prompt_tokens: int = 1024
    output_tokens: int = 32
    cut_after_tokens: int = 16  # router-decode and frozen-decode: at the first stream's
    dtype: str = "float32"
    kv_cache_gib: int = 1
    link_gbit: float = 10.0
    pull_link_gbit: float = 0.05  # prefill-decode: prefill's link while it is cut
    etcd_ttl_s: int = 3
    kv_stall_s: float = 2.0
    lease_s: float = 10.0
    whole_timeout_s: float = 60.0
    request_timeout_s: float = 120.0
    seed: int = 0
    log_dir: str = ""  # "": ~/.cache/pdserve/bench-partitions

    def __post_init__(self) -> None:
        unknown = [f for f in self.fault_list if f not in PARTITIONS]
        if unknown or not self.fault_list:
            raise ValueError(f"--faults: comma-separated, of {', '.join(PARTITIONS)}; "
                             f"unknown: {', '.join(unknown) or '(none given)'}")
        if min(self.reps, self.streams, self.prompt_tokens, self.output_tokens) < 1:
            raise ValueError("--reps, --streams, --prompt-tokens, --output-tokens: >= 1")
        if not 0 < self.cut_after_tokens < self.output_tokens:
            raise ValueError("--cut-after-tokens: between 1 and --output-tokens - 1")
        if not (self.link_gbit > 0 and self.pull_link_gbit > 0):
            raise ValueError("--link-gbit and --pull-link-gbit: positive Gbit/s")

    @property
    def fault_list(self) -> list[str]:
        return [f for f in self.faults.split(",") if f]


@dataclass(frozen=True)
class LinkAwareConfig:
    """``pdserve bench link-aware`` (``link_aware.py``)."""

    link_gbit: str = "1,0.1"  # prefill's link, comma-separated Gbit/s, each in turn
    requests: int = 12  # per router and rate
    prompt_tokens: str = "1024,2048"  # comma-separated lengths, in turn
    output_tokens: int = 16
    rate: float = 0.25  # req/s, Poisson
    dtype: str = "float32"
    kv_cache_gib: int = 2
    kv_compression: str = "none"  # the workers' --kv-compression (lossless: handoffs too)
    prefills: int = 1  # 2: a second prefill behind a link never shaped (placement)
    out: str = ""  # a folder under bench/results ("": named from the run's settings)
    seed: int = 0
    request_timeout_s: float = 300.0
    log_dir: str = ""  # "": ~/.cache/pdserve/bench-link-aware

    def __post_init__(self) -> None:
        if self.prefills not in (1, 2):
            raise ValueError("--prefills: 1 or 2")
        if self.out.startswith("/") or ".." in self.out.split("/"):
            raise ValueError("--out: a folder under bench/results, not a path out of it")
        if not self.link_rates or any(r <= 0 for r in self.link_rates):
            raise ValueError("--link-gbit: positive Gbit/s, comma-separated")
        if not self.lengths or any(n < 1 for n in self.lengths):
            raise ValueError("--prompt-tokens: positive token counts, comma-separated")
        if self.requests < 1 or self.output_tokens < 1 or not self.rate > 0:
            raise ValueError("--requests and --output-tokens must be >= 1, --rate > 0")

    @property
    def link_rates(self) -> list[float]:
        return [float(r) for r in self.link_gbit.split(",") if r]

    @property
    def lengths(self) -> list[int]:
        return [int(n) for n in self.prompt_tokens.split(",") if n]
