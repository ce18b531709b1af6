"""Per-tenant counters (``pdserve:tenant_*``), labelled by the configured tenants only:
a named tenant's name, or ``key-<n>`` for a key without one (never the key), so the
series are as many as the configured tenants whatever clients send, and every one of
them is exported from 0 at start.

  pdserve:tenant_requests_total{tenant}             generation requests it sent (those
                                                    its limits refused included)
  pdserve:tenant_rejections_total{tenant,reason}    refused by its limits: concurrency
                                                    (max_concurrent) or tokens (tokens_per_s)
  pdserve:tenant_prompt_tokens_total{tenant}        prompt tokens of its requests
  pdserve:tenant_cached_tokens_total{tenant}        of those, found in a prefix cache
  pdserve:tenant_completion_tokens_total{tenant}    tokens generated for it (every choice)
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter

from pdserve.router.metrics import PREFIX, NullMetric, counter


class TenantCounters:
    """One tenant's children, bound once."""

    __slots__ = ("cached_tokens", "completion_tokens", "prompt_tokens", "rejections",
                 "requests")

    def __init__(self, requests: Counter | NullMetric, prompt_tokens: Counter | NullMetric,
                 cached_tokens: Counter | NullMetric, completion_tokens: Counter | NullMetric,
                 rejections: dict[str, Counter | NullMetric]) -> None:
        self.requests = requests
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.completion_tokens = completion_tokens
        self.rejections = rejections


class TenantMetrics:
    def __init__(self, registry: CollectorRegistry | None, tenants: Sequence[str],
                 reasons: Sequence[str]) -> None:
        r, label = registry, ["tenant"]
        requests = counter(r, f"{PREFIX}tenant_requests", "Generation requests a tenant "
                           "sent, those its limits refused included.", label)
        rejections = counter(r, f"{PREFIX}tenant_rejections", "Generation requests a "
                             "tenant's own limits refused (429), by reason: concurrency "
                             "(max_concurrent) or tokens (tokens_per_s).",
                             ["tenant", "reason"])
        prompt = counter(r, f"{PREFIX}tenant_prompt_tokens", "Prompt tokens of a tenant's "
                         "requests.", label)
        cached = counter(r, f"{PREFIX}tenant_cached_tokens", "A tenant's prompt tokens "
                         "found in a prefix cache.", label)
        completion = counter(r, f"{PREFIX}tenant_completion_tokens", "Tokens generated for "
                             "a tenant's requests (every choice).", label)
        self._of = {name: TenantCounters(
            requests.labels(name), prompt.labels(name), cached.labels(name),
            completion.labels(name), {why: rejections.labels(name, why) for why in reasons})
            for name in tenants}

    def of(self, tenant: str) -> TenantCounters:
        return self._of[tenant]
