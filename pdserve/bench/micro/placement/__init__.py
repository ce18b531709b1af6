"""``pdserve bench placement`` (cache-aware vs round-robin on real vLLM) and
``placement-decision`` (decision time at scale), and their shared-prefix workload."""
