"""What loading a prompt token from a KV tier or the cluster pool costs on one worker,
as a fraction of computing it there, from what the worker measured.

A worker's ``GetLoad`` counts, per source, the blocks it loaded and the time and bytes
that took (host tier: ``kv_tier_load_*``; disk tier: ``kv_disk_load_*``; pool, pulled
from peers' host tiers: ``kv_pool_load_*``), and fits its step time (``StepCost``: the
seconds one prompt token adds to a step). A source's cost ratio is then

    (load seconds / loaded blocks / block size) / compute seconds per prompt token

so 0 is free (the engine's own cache), 1 is as dear as computing the token.

The cluster KV store (``--kv-store``): its measured seconds per block where
``KvLoadRates.store_s_per_block`` is set (the worker's ``kv_store_load_time_ns`` over
``kv_store_load_blocks``, once it has loaded from the store), else its prior; either
raised to twice the worker's host-tier ratio where that is dearer (a block over the
network never costs less than a copy from the worker's own memory), so a prefix in the
store is dearer than the worker's own host tier, and used only while cheaper than
computing it.

Before a source has been measured on a worker, or while the worker's step fit has not
timed a prefill (no per-token compute to compare with), the ratio falls back to:

- pool: the worker's P/D pull bandwidth (``kv_transfer_time_ns / kv_bytes_received``,
  the same transport between the same kind of hosts) times a block's bytes (from any
  source's ``*_load_bytes / *_load_blocks``), when it has both;
- otherwise a prior, below.

Known limit: a pool measured dearer than compute is not used, so not measured again; it
is retried only if the step fit moves (compute slows under load, say).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.types import WorkerLoadReport

# Priors (cost ratios) for a source not measured yet on the worker. Each is replaced by
# the worker's measurement after its first load from that source.
# Host tier: a host-memory copy of a token's KV (tens to hundreds of KiB) takes a few us
# at memory or PCIe bandwidth; computing the token takes tens of us (GPU, a few billion
# parameters) to ms (CPU). A small nonzero ratio: an engine-cache hit stays preferred.
HOST_PRIOR_RATIO = 0.05
# Disk tier: a few GB/s (NVMe) is cheap against CPU compute and near GPU compute for
# large-KV models. Cheaper than computing, not free. The worker loads from its disk tier
# whatever the router thinks, so this prior only weighs placement until measured.
DISK_PRIOR_RATIO = 0.5
# Pool: a peer's host tier over the KV transport, bandwidth like the P/D pulls. Below 1
# on purpose: the router only sets a pool source whose ratio is below 1, and a source
# never used is never measured; a first pull that is slow or fails costs at most the
# recompute it would have done anyway.
POOL_PRIOR_RATIO = 0.5
# Store: a block from the cluster KV store (Redis) over the network, GET at ~1.5-6 GB/s
# on one server: dearer than a host copy, a fraction of CPU compute. The worker decides
# per request whether to fetch (it measures the store and its prefill); this weighs
# placement only. Kept at least ``STORE_OVER_HOST`` times the host tier's ratio.
STORE_PRIOR_RATIO = 0.3
STORE_OVER_HOST = 2.0


@dataclass(frozen=True, slots=True)
class KvLoadRates:
    """A worker's measured KV loads, cumulative averages (None: not measured yet)."""

    host_s_per_block: float | None = None
    disk_s_per_block: float | None = None
    pool_s_per_block: float | None = None
    # P/D pulls (this worker as the loading side): seconds per byte received.
    pull_s_per_byte: float | None = None
    block_bytes: float | None = None  # one block, all layers, as loads moved it
    store_s_per_block: float | None = None  # the cluster KV store (GetLoad kv_store_*)


NOT_MEASURED = KvLoadRates()


@dataclass(frozen=True, slots=True)
class TierRatios:
    """Loading one prompt token from each source, in computed-token equivalents."""

    host: float = HOST_PRIOR_RATIO
    disk: float = DISK_PRIOR_RATIO
    pool: float = POOL_PRIOR_RATIO
    store: float = STORE_PRIOR_RATIO


PRIOR_RATIOS = TierRatios()


def _per(amount: int, count: int) -> float | None:
    return amount / count if amount > 0 and count > 0 else None


def load_rates(report: WorkerLoadReport) -> KvLoadRates:
    """The rates of ``report``'s cumulative counters."""
    r = report
    host = _per(r.kv_tier_load_time_ns, r.kv_tier_load_blocks)
    disk = _per(r.kv_disk_load_time_ns, r.kv_disk_load_blocks)
    pool = _per(r.kv_pool_load_time_ns, r.kv_pool_load_blocks)
    pull = _per(r.kv_transfer_time_ns, r.kv_bytes_received)
    store = _per(r.kv_store_load_time_ns, r.kv_store_load_blocks)
    block_bytes = (_per(r.kv_tier_load_bytes, r.kv_tier_load_blocks)
                   or _per(r.kv_disk_load_bytes, r.kv_disk_load_blocks)
                   or _per(r.kv_pool_load_bytes, r.kv_pool_load_blocks))
    if not (host or disk or pool or pull or store):
        return NOT_MEASURED
    return KvLoadRates(None if host is None else host / 1e9,
                       None if disk is None else disk / 1e9,
                       None if pool is None else pool / 1e9,
                       None if pull is None else pull / 1e9, block_bytes,
                       None if store is None else store / 1e9)


def tier_ratios(rates: KvLoadRates, compute_s_per_token: float | None,
                block_size: int) -> TierRatios:
    """The cost ratio of each source on a worker computing a prompt token in
    ``compute_s_per_token`` (None: not measured; the priors then) with blocks of
    ``block_size`` tokens."""
    if rates is NOT_MEASURED or not compute_s_per_token or compute_s_per_token <= 0:
        return PRIOR_RATIOS
    per_token = 1.0 / (block_size * compute_s_per_token)
    pool_s = rates.pool_s_per_block
    if pool_s is None and rates.pull_s_per_byte is not None and rates.block_bytes:
        pool_s = rates.pull_s_per_byte * rates.block_bytes
    host = _ratio(rates.host_s_per_block, per_token, HOST_PRIOR_RATIO)
    return TierRatios(host, _ratio(rates.disk_s_per_block, per_token, DISK_PRIOR_RATIO),
                      _ratio(pool_s, per_token, POOL_PRIOR_RATIO),
                      max(_ratio(rates.store_s_per_block, per_token, STORE_PRIOR_RATIO),
                          STORE_OVER_HOST * host))


def _ratio(s_per_block: float | None, per_token: float, prior: float) -> float:
    return prior if s_per_block is None else s_per_block * per_token
