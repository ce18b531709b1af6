"""The connector's counters GetLoad reports, by name (``worker.host.load_report``): the
KV tiers' (``tiers/store.py``) and the cluster store's (``remote/``). A module of their
own, so that a worker host reads the names without importing torch and vLLM."""

# GetLoad's kv_tier_* (host), kv_disk_* (disk) and kv_pool_* (peers' host tiers)
# counters: the worker side's own, the scheduler side's (misses, evictions), which
# reach it with each step's metadata, and the transport's (pool_serve_refusals).
TIER_STATS = (*(f"{tier}_{name}" for tier in ("tier", "disk") for name in (
    "loads", "load_blocks", "load_time_ns", "load_failures", "saves", "save_blocks",
    "save_failures")),
    "pool_loads", "pool_load_blocks", "pool_load_time_ns", "pool_load_failures",
    "pool_serves", "pool_serve_blocks", "pool_serve_failures",
    "tier_load_bytes", "disk_load_bytes", "pool_load_bytes",
    "tier_miss_blocks", "tier_evictions", "disk_evictions",
    "pool_load_refusals", "pool_serve_refusals")


# GetLoad's kv_store_* counters: the scheduler side's (``remote/plan.py``'s ``COUNTS``,
# which reach the worker side with each step) and the worker side's (``remote/worker.py``).
STORE_STATS = ("store_lookups", "store_hit_blocks", "store_lookup_errors",
               "store_lookup_timeouts", "store_lookups_skipped", "store_fetch_chosen",
               "store_compute_chosen", "store_loads", "store_load_blocks", "store_load_bytes",
               "store_load_time_ns", "store_load_failures", "store_load_missing",
               "store_bad_blocks", "store_bad_deleted", "store_timeouts", "store_save_blocks",
               "store_save_dropped", "store_put_written", "store_put_failures",
               "store_not_admitted")
