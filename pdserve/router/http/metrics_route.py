"""``GET /metrics``: every series on the admin plane (and on an open main port, one
without API keys); on a main port with keys, a tenant's own ``pdserve:tenant_*`` series
only (those labelled with its tenant), nothing of the workers or of other tenants."""

from __future__ import annotations

from collections.abc import Iterator

from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from starlette.responses import Response

from pdserve.router.http.errors import RouteNotFoundError, error_response
from pdserve.router.http.openapi import ERROR_RESPONSES
from pdserve.router.http.tenants.accounts import TENANT, TenantAccount
from pdserve.router.metrics import METRICS_DISABLED_ENV, PREFIX

TENANT_SERIES = f"{PREFIX}tenant_"


class TenantView:
    """A collector of ``registry``'s samples labelled ``tenant=<name>`` in the tenant
    families, for ``generate_latest``."""

    def __init__(self, registry: CollectorRegistry, tenant: str) -> None:
        self._registry = registry
        self._tenant = tenant

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            if not family.name.startswith(TENANT_SERIES):
                continue
            own = Metric(family.name, family.documentation, family.type, family.unit)
            own.samples = [s for s in family.samples if s.labels.get("tenant") == self._tenant]
            if own.samples:
                yield own


def metrics_routes(registry: CollectorRegistry | None, per_tenant: bool = False) -> APIRouter:
    """``per_tenant``: each caller sees only its tenant's series (the main port with
    keys: the key middleware put its ``TenantAccount`` in the scope)."""
    router = APIRouter()

    @router.get("/metrics", response_class=Response, responses=ERROR_RESPONSES)
    async def prometheus_metrics(request: Request) -> Response:
        if registry is None:
            return error_response(RouteNotFoundError(
                "metrics are disabled on this router (--disable-metrics / "
                f"{METRICS_DISABLED_ENV})", code="metrics_disabled"))
        if not per_tenant:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
        account: TenantAccount | None = request.scope.get(TENANT)
        text = b"" if account is None else generate_latest(TenantView(registry, account.name))
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return router
