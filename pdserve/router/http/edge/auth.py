"""Client authentication: ``Authorization: Bearer <key>`` on the protected paths.

A presented key is compared with every configured key in constant time
(``hmac.compare_digest``, and no early exit), so neither the response time nor which
key matched says anything about the keys. Without configured keys nothing is checked.
The matched key's tenant (``tenants/accounts.py``) goes in the request's scope.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.http.errors import AuthenticationError, send_error
from pdserve.router.http.tenants.accounts import TENANT, TenantAccount
from pdserve.router.http.tenants.salt import TENANT_SALT

# On the main port with keys set: behind a client key, /metrics showing the caller's tenant
# only, and the cluster views not served at all (404); the admin plane has its own key.
ADMIN_PATHS = frozenset({"/metrics", "/workers", "/prefix_index"})


def is_protected(path: str) -> bool:
    return path.startswith("/v1/") or path in ADMIN_PATHS


class ApiKeys:
    def __init__(self, keys: Sequence[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    def __bool__(self) -> bool:
        return bool(self._keys)

    def check(self, authorization: bytes | None) -> AuthenticationError | None:
        """The error to answer with, or None when the header carries a valid key."""
        found = self.match(authorization)
        return found if isinstance(found, AuthenticationError) else None

    def match(self, authorization: bytes | None) -> bytes | AuthenticationError:
        """The configured key the header carries, or the error to answer with."""
        if authorization is None:
            return AuthenticationError(
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key")
        scheme, _, given = authorization.partition(b" ")
        given = given.strip()
        matched: bytes | None = None
        for key in self._keys:  # every key, whatever matched: constant time
            if hmac.compare_digest(given, key):
                matched = key
        if scheme.lower() != b"bearer" or matched is None:
            return AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return matched


class ApiKeyMiddleware:
    """Puts each matched key's tenant in the scope (``TENANT``), and its salt
    (``TENANT_SALT``) under ``--tenant-isolation key`` (``tenants/salt.py``)."""

    def __init__(self, app: ASGIApp, keys: ApiKeys,
                 tenants: Mapping[bytes, TenantAccount] | None = None) -> None:
        self.app = app
        self._keys = keys
        self._tenants = tenants or {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._keys and is_protected(scope["path"]):
            found = self._keys.match(authorization_header(scope))
            if isinstance(found, AuthenticationError):
                await send_error(scope, send, found)
                return
            tenant = self._tenants.get(found)
            if tenant is not None:
                scope[TENANT] = tenant
                if tenant.salt is not None:
                    scope[TENANT_SALT] = tenant.salt
        await self.app(scope, receive, send)


def authorization_header(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value)
    return None
