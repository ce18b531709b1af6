"""Tenants at the edge: who sent a request, whether its limits admit it, what it spent.

Every configured key belongs to one tenant (``table.py``: a named tenant, or the
key alone as ``key-<n>``), and each tenant has one ``TenantAccount``: its salt (for
``--tenant-isolation key``), its limiter (``limits.py``) and its counters
(``metrics/tenants.py``). ``ApiKeyMiddleware`` puts the account of the key that matched in
the request's scope (``TENANT``); then, on the generation paths:

1. ``TenantLimitMiddleware`` admits the request (one slot) or answers 429 with
   ``Retry-After`` before its body is read, and before the global admission
   (``admission.py``), so a tenant over its limits neither waits in nor takes a place
   of the global queue;
2. once the body is read, a request that samples ``n`` > 1 sequences takes ``n - 1``
   more slots (``on_sequences``): 429 when they are not free now, 400 when ``n`` is
   over the tenant's ``max_concurrent`` (it could never run). ``best_of`` > 1 is
   refused by the schema (vLLM's V1 engine has none), so it never counts more;
3. the endpoint charges the prompt tokens once it has tokenized them (``on_prompt``);
4. when the generation has ended, however it ended (stream, error, client gone), the
   completion tokens are charged, the cached ones counted from the request's outputs,
   and the tenant's slots freed (``end_request``): by the endpoint before it writes the
   response's last bytes, so a client that sends its next request as soon as it has read
   the last one finds it charged and its slots free; else by the middleware, once the
   response is over.

The limits' state is in a ``TenantLedger`` (``ledger.py``), shared by every process of
``--processes N`` (``edge.tenant_ledger``): the limits hold exactly across them.

Nothing is done per streamed token: the counts are read from the outputs at the end,
whichever way (the request's task, or its stream writer from the session's reader)
carried the tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.router.http.edge.config import NEEDS_SECRET, EdgeConfig
from pdserve.router.http.errors import InvalidRequestError, TooManyRequestsError, send_error
from pdserve.router.http.openai.request_output import RequestOutput, completion_tokens
from pdserve.router.http.tenants.ledger import TenantLedger
from pdserve.router.http.tenants.limits import REJECT_REASONS, Refusal, TenantLimiter
from pdserve.router.http.tenants.salt import tenant_name_salt, tenant_salt
from pdserve.router.http.tenants.table import TenantLimits, key_label
from pdserve.router.metrics.tenants import TenantCounters, TenantMetrics

TENANT = "pdserve.tenant"  # the ASGI scope key of the request's TenantAccount
_OUTPUTS = "pdserve.tenant_outputs"  # the request's outputs, read when it ends
_HELD = "pdserve.tenant_slots"  # the slots the request holds (its sequences)
RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's error code for a per-client rate limit


class TenantAccount:
    __slots__ = ("_counters", "_limiter", "name", "salt")

    def __init__(self, name: str, salt: str | None, limiter: TenantLimiter | None,
                 counters: TenantCounters) -> None:
        self.name = name
        self.salt = salt  # None: no --tenant-isolation key
        self._limiter = limiter
        self._counters = counters

    @property
    def limiter(self) -> TenantLimiter | None:
        return self._limiter

    def admit(self) -> TooManyRequestsError | None:
        """Take a slot for one request (None), or the 429 to answer."""
        self._counters.requests.inc()
        return self._acquire(1)

    def widen(self, num_more: int) -> InvalidRequestError | TooManyRequestsError | None:
        """Take ``num_more`` slots more for an admitted request's other sequences (None),
        or the error to answer: 400 if they could never fit, else 429."""
        maximum = None if self._limiter is None else self._limiter.limits.max_concurrent
        if maximum is not None and 1 + num_more > maximum:
            self._counters.rejections["concurrency"].inc()
            return InvalidRequestError(
                f"n={1 + num_more} sequences are more than tenant {self.name}'s limit of "
                f"{maximum} concurrent sequences", param="n", code="n_over_tenant_limit")
        return self._acquire(num_more)

    def _acquire(self, num: int) -> TooManyRequestsError | None:
        refusal = None if self._limiter is None else self._limiter.acquire(num)
        if refusal is None:
            return None
        self._counters.rejections[refusal.reason].inc()
        return TooManyRequestsError(self._message(refusal), refusal.retry_after_s,
                                    code=RATE_LIMITED)

    def charge_prompt(self, num_tokens: int) -> None:
        self._counters.prompt_tokens.inc(num_tokens)
        if self._limiter is not None:
            self._limiter.charge(num_tokens)

    def end(self, outputs: Sequence[RequestOutput] | None, num_slots: int = 1) -> None:
        """The request has ended: charge what it generated and free its ``num_slots``."""
        if outputs:
            num_completion = completion_tokens(outputs)
            self._counters.completion_tokens.inc(num_completion)
            self._counters.cached_tokens.inc(outputs[0].num_cached_tokens)
            if self._limiter is not None:
                self._limiter.charge(num_completion)
        if self._limiter is not None:
            self._limiter.release(num_slots)

    def _message(self, refusal: Refusal) -> str:
        limits = self._limiter.limits if self._limiter is not None else TenantLimits()
        if refusal.reason == "tokens":
            return (f"Tenant {self.name} is over its limit of {limits.tokens_per_s:g} tokens "
                    f"per second (prompt + completion); retry after "
                    f"{refusal.retry_after_s} s.")
        return (f"Tenant {self.name} is at its limit of {limits.max_concurrent} concurrent "
                "sequences; retry when one of its requests has ended.")


def tenant_accounts(edge: EdgeConfig, registry: CollectorRegistry | None,
                    secret: ClusterSecret | None = None,
                    clock: Callable[[], float] = time.monotonic) -> dict[bytes, TenantAccount]:
    """Every configured key's account (keys of one tenant share one), its counters on
    ``registry`` (None: metrics off), its limits ``edge.tenant_limits_share`` of the
    configured ones. ``secret``: the cluster secret, which keys the salts of
    ``--tenant-isolation key`` (ValueError without one then)."""
    if edge.tenant_isolation == "key" and secret is None:
        raise ValueError(NEEDS_SECRET)
    tenants = list(_tenants(edge))
    metrics = TenantMetrics(registry, [name for name, _, _, _ in tenants], REJECT_REASONS)
    ledger = (TenantLedger.local(len(tenants)) if edge.tenant_ledger is None
              else TenantLedger.open(Path(edge.tenant_ledger), len(tenants)))
    accounts: dict[bytes, TenantAccount] = {}
    for index, (name, keys, limits, named) in enumerate(tenants):
        salt = None
        if secret is not None and edge.tenant_isolation == "key":
            salt = (tenant_name_salt(secret, name) if named
                    else tenant_salt(secret, keys[0].encode()))
        limiter = None if not limits else \
            TenantLimiter(limits.share(edge.tenant_limits_share), clock, ledger, index)
        account = TenantAccount(name, salt, limiter, metrics.of(name))
        accounts.update((key.encode(), account) for key in keys)
    return accounts


def _tenants(edge: EdgeConfig) -> Iterator[tuple[str, tuple[str, ...], TenantLimits, bool]]:
    """(label, keys, limits, named) of every tenant: the named ones (salted by their
    name: every key of a tenant is that one tenant), then each other key alone (salted
    by the key, as with no names)."""
    named = {key for tenant in edge.tenants for key in tenant.keys}
    for tenant in edge.tenants:
        yield tenant.name, tenant.keys, tenant.limits, True
    for index, key in enumerate(edge.api_keys):
        if key not in named:
            yield key_label(index), (key,), TenantLimits(), False


def num_tenants(edge: EdgeConfig) -> int:
    """How many tenants (accounts) ``edge`` has: the size of its ledger."""
    return sum(1 for _ in _tenants(edge))


def on_sequences(scope: Scope, num_sequences: int) -> None:
    """The request samples ``num_sequences``: its tenant's slots for the others are
    taken, or the ``APIError`` to answer is raised (400: never fits, 429: not now)."""
    account: TenantAccount | None = scope.get(TENANT)
    if account is None or num_sequences <= 1 or _HELD not in scope:
        return
    refused = account.widen(num_sequences - 1)
    if refused is not None:
        raise refused
    scope[_HELD] = num_sequences


def end_request(scope: Scope) -> None:
    """The request's generation has ended: its tenant is charged for what it generated
    and its slots are freed, once (later calls do nothing)."""
    held = scope.pop(_HELD, 0)
    account: TenantAccount | None = scope.get(TENANT)
    if held and account is not None:
        account.end(scope.get(_OUTPUTS), held)


def on_prompt(scope: Scope, num_prompt_tokens: int, outputs: Sequence[RequestOutput]
              ) -> None:
    """The request's prompt is tokenized (``outputs``: its choices, read when it ends)."""
    account: TenantAccount | None = scope.get(TENANT)
    if account is not None:
        account.charge_prompt(num_prompt_tokens)
        scope[_OUTPUTS] = outputs


class TenantLimitMiddleware:
    """Holds a tenant's slot for the whole response of a generation request."""

    def __init__(self, app: ASGIApp, paths: frozenset[str]) -> None:
        self.app = app
        self._paths = paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        account: TenantAccount | None = None
        if scope["type"] == "http" and scope["path"] in self._paths:
            account = scope.get(TENANT)
        if account is None:
            await self.app(scope, receive, send)
            return
        refused = account.admit()
        if refused is not None:
            await send_error(scope, send, refused)
            return
        scope[_HELD] = 1
        try:
            await self.app(scope, receive, send)
        finally:
            end_request(scope)
