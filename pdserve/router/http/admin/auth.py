"""The admin plane's credential, checked on the whole admin app before routing, body
reading or parsing: a caller without the key learns nothing about a route's body, and
sends none of it to a parser.

With admin keys, every path but ``PUBLIC_PATHS`` needs ``Authorization: Bearer <key>``
with one of them (compared in constant time, ``edge/auth.py``): 401 otherwise. A client
API key is never an admin key (``EdgeConfig`` refuses a key that is both). Without admin
keys the listener binds loopback only (``EdgeConfig.admin_bind_host``) and the plane is
open to the machine's own users; built on a non-loopback address without keys (which
the router never does), every path but the public ones answers 403.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.http.edge.auth import ApiKeys, authorization_header
from pdserve.router.http.edge.config import is_loopback
from pdserve.router.http.errors import PermissionDeniedError, send_error

# Liveness for orchestrators' probes (the chart's): says nothing about the cluster.
PUBLIC_PATHS = frozenset({"/health"})


class AdminAuthMiddleware:
    """Pure ASGI, outermost on the admin app: it answers before the app reads ``receive``."""

    def __init__(self, app: ASGIApp, keys: Sequence[str], bind_host: str) -> None:
        self.app = app
        self._keys = ApiKeys(keys)
        self._open = not keys and is_loopback(bind_host)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # no websocket (or other) route: refused unread
            return
        if scope["path"] not in PUBLIC_PATHS:
            if self._keys:
                error = self._keys.check(authorization_header(scope))
                if error is not None:
                    await send_error(scope, send, error)
                    return
            elif not self._open:
                await send_error(scope, send, PermissionDeniedError(
                    "the admin plane needs an admin key on a non-loopback listener: set "
                    "--admin-key-file (or --admin-key)", code="admin_key_required"))
                return
        await self.app(scope, receive, send)

