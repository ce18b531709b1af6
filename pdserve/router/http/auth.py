"""Client authentication: ``Authorization: Bearer <key>`` on the protected paths.

A presented key is compared with every configured key in constant time
(``hmac.compare_digest``, and no early exit), so neither the response time nor which
key matched says anything about the keys. Without configured keys nothing is checked.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.types import ASGIApp, Receive, Scope, Send

from pdserve.router.http.errors import AuthenticationError, send_error

# Served on the main port only with a key (when keys are set); on the admin port without.
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
        if authorization is None:
            return AuthenticationError(
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key")
        scheme, _, given = authorization.partition(b" ")
        matched = False
        for key in self._keys:  # every key, whatever matched: constant time
            matched |= hmac.compare_digest(given.strip(), key)
        if scheme.lower() != b"bearer" or not matched:
            return AuthenticationError("Incorrect API key provided.", code="invalid_api_key")
        return None


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app = app
        self._keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._keys and is_protected(scope["path"]):
            error = self._keys.check(_authorization(scope))
            if error is not None:
                await send_error(scope, send, error)
                return
        await self.app(scope, receive, send)


def _authorization(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return bytes(value)
    return None
