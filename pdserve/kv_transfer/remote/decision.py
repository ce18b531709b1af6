"""Fetch or compute: whether a prompt's blocks found in the cluster KV store are worth
loading, decided per request from what this worker measured.

A store load costs one round trip plus the blocks' bytes at the store's throughput;
computing the same tokens costs the engine's prefill time per token. Both are learned:

- ``rtt_s``: the scheduler side's own lookups (one round trip each), a moving average;
- ``bytes_per_s``: the worker side's finished store loads (bytes ÷ seconds, the get, the
  check and the copy into the cache), a moving average;
- ``per_token_s``: the engine's step-time fit (``step_model.StepModel``: seconds per
  prompt token), reported by the worker side with each step.

``fetch(num_blocks)`` is True when ``rtt + bytes / throughput`` is below ``margin`` times
the compute time. Until a store load has been measured, the throughput is a prior
(``PRIOR_BYTES_PER_S``, a loopback Redis's order), so the first loads happen and teach
the real figure; until the engine has prefilled (its per-token time unknown: a prior
would be off by 100x between a CPU and a GPU), the store is fetched from. The break-even
(``break_even_tokens``: the fewest tokens worth a fetch) says where the choice turns.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_BYTES_PER_S = 500e6  # a loopback Redis GET of MiB values: 0.5-0.8 GiB/s measured
PRIOR_RTT_S = 0.5e-3
_ALPHA = 0.2  # weight of each new sample in the moving averages


@dataclass
class FetchDecision:
    block_bytes: int  # one block's stored bytes (all layers)
    block_size: int  # tokens per block
    margin: float = 1.0  # fetch when the fetch is below margin x compute
    rtt_s: float = PRIOR_RTT_S
    bytes_per_s: float = PRIOR_BYTES_PER_S
    per_token_s: float | None = None  # None: the engine has not prefilled yet
    num_load_samples: int = 0

    def fetch_s(self, num_blocks: int) -> float:
        return self.rtt_s + num_blocks * self.block_bytes / self.bytes_per_s

    def compute_s(self, num_blocks: int) -> float | None:
        if self.per_token_s is None:
            return None
        return num_blocks * self.block_size * self.per_token_s

    def fetch(self, num_blocks: int) -> bool:
        """Load ``num_blocks`` from the store (True) or compute them (False)."""
        compute = self.compute_s(num_blocks)
        return num_blocks > 0 and (compute is None
                                   or self.fetch_s(num_blocks) < self.margin * compute)

    def break_even_tokens(self) -> int:
        """The fewest prompt tokens a store fetch beats computing (0: never, or not
        known yet)."""
        if self.per_token_s is None:
            return 0
        per_block_gain = self.margin * self.block_size * self.per_token_s - (
            self.block_bytes / self.bytes_per_s)
        if per_block_gain <= 0:
            return 0
        return (int(self.rtt_s / per_block_gain) + 1) * self.block_size

    def on_rtt(self, seconds: float) -> None:
        if seconds > 0:
            self.rtt_s += _ALPHA * (seconds - self.rtt_s)

    def on_load(self, nbytes: int, seconds: float) -> None:
        """A finished store load: its bytes and how long it took (its round trip
        included, which is taken out with the current estimate)."""
        if nbytes <= 0 or seconds <= 0:
            return
        rate = nbytes / max(seconds - self.rtt_s, seconds / 2)
        if self.num_load_samples == 0:
            self.bytes_per_s = rate
        else:
            self.bytes_per_s += _ALPHA * (rate - self.bytes_per_s)
        self.num_load_samples += 1

    def on_per_token(self, seconds: float) -> None:
        if seconds > 0:
            self.per_token_s = seconds
