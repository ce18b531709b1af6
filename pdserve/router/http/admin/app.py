"""The admin listener's app: the views (the full ``/metrics``, and ``routers``: the
cluster views, the actions) behind the admin key, checked first (``auth.py``), then the
body limit (``edge/body_limit.py``); ``/health`` open, for probes."""

from __future__ import annotations

from collections.abc import Sequence

from fastapi import APIRouter, FastAPI
from prometheus_client import CollectorRegistry

from pdserve.router.http.admin.auth import AdminAuthMiddleware
from pdserve.router.http.edge.body_limit import BodyLimitMiddleware
from pdserve.router.http.edge.config import DEFAULT_MAX_BODY_BYTES
from pdserve.router.http.errors import install_error_handlers
from pdserve.router.http.metrics_route import metrics_routes


def create_admin_app(registry: CollectorRegistry | None, *routers: APIRouter,
                     keys: Sequence[str] = (), bind_host: str = "127.0.0.1",
                     max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    """``registry`` None: metrics off (``/metrics`` 404). ``keys``: the admin keys
    (none: open, on a loopback ``bind_host`` only)."""
    app = FastAPI(title="pdserve router admin", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(metrics_routes(registry))
    for router in routers:
        app.include_router(router)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    # Added last: outermost. The key before anything reads the body.
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes)
    app.add_middleware(AdminAuthMiddleware, keys=tuple(keys), bind_host=bind_host)
    return app
