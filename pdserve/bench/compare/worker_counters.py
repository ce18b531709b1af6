"""What a pdserve system's workers counted during a bench run: every worker's ``/metrics``
(their endpoints from the router's ``GET /workers``) read before and after it, summed
per role. The KV bytes decode loaded per request say what each handoff moved (with
the decode-side cache, a conversation's next turn loads only its new blocks); the
engines' prompt and prefix-cache counters say what each role computed."""

from __future__ import annotations

from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Sample name -> its key in the result (summed over a role's workers).
COUNTERS = {
    "pdserve:kv_transfer_bytes_received_total": "kv_bytes_received",
    "pdserve:kv_transfer_bytes_sent_total": "kv_bytes_sent",
    "pdserve:kv_loads_total": "kv_loads",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_hits_total": "prefix_cache_hit_tokens",
}
_TIMEOUT_S = 5.0

Counters = dict[str, dict[str, float]]  # role -> key -> value


def read_counters(base_url: str, transport: httpx.BaseTransport | None = None
                  ) -> Counters | None:
    """Every worker's counters now, summed per role (the role each serves now); None
    when the router or a worker's ``/metrics`` cannot be read (workers without a
    metrics endpoint count nothing)."""
    try:
        with httpx.Client(timeout=_TIMEOUT_S, transport=transport) as client:
            workers = client.get(base_url.rstrip("/") + "/workers").json()["workers"]
            out: Counters = {}
            for w in workers:
                endpoint = w.get("metrics_endpoint")
                if not endpoint:
                    continue
                text = client.get(f"http://{endpoint}/metrics").text
                sums = out.setdefault(str(w.get("role")), dict.fromkeys(COUNTERS.values(), 0.0))
                for family in text_string_to_metric_families(text):
                    for sample in family.samples:
                        if (key := COUNTERS.get(sample.name)) is not None:
                            sums[key] += sample.value
            return out
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def counters_delta(before: Counters | None, after: Counters | None,
                   num_completed: int) -> dict[str, Any] | None:
    """What the run added, per role, and the KV MiB decode loaded per completed request;
    None without both readings."""
    if before is None or after is None:
        return None
    roles = {role: {k: v - before.get(role, {}).get(k, 0.0) for k, v in sums.items()}
             for role, sums in after.items()}
    received = sum(r["kv_bytes_received"] for r in roles.values())
    return {"roles": roles, "kv_mib_per_request": (received / 2**20 / num_completed
                                                   if num_completed else None)}
