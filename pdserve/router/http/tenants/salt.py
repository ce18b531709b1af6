"""Tenant isolation by API key (``--tenant-isolation key``): each key is a tenant, and
every request it authenticates is salted with ``tenant_salt(key)``, a keyed hash of the
key (never the key), combined with the request's own ``cache_salt`` if it sent one, never
replaced by it. Keys that name one tenant in the key table (``table.py``) are that
one tenant: their requests are salted with ``tenant_name_salt(name)``, so the tenant's
cache survives adding or rotating its keys. Requests under different salts share no
cached KV anywhere in the cluster (``core.block_hash.salt_root``, vLLM's own
``cache_salt``), and so no cached-token count or prompt-cache timing difference tells one
tenant what another sent.

A client cannot reach another tenant's salt by its own ``cache_salt``: under isolation
its own salt is always hashed with its tenant's (``salted``); and every salt derived
here starts with ``@``, which a client's own salt may not hold (vLLM's rule, a 400), so
even through a router without isolation on the same workers, no client salt equals a
tenant's (a tenant name is public, on ``/metrics``; the derivation is in this file).
``ApiKeyMiddleware`` puts the salt in the request's ASGI scope
(``TENANT_SALT``) once the key matched; the endpoints fold it into the body
(``salted``)."""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from hashlib import blake2b, sha256
from typing import Any

TENANT_SALT = "pdserve.tenant_salt"  # the ASGI scope key
# The HMAC key: the salt must be a one-way function of the API key that every router
# replica computes the same (a tenant's prefixes are shared across replicas), and it
# never leaves the cluster (workers get it, clients never see it).
_LABEL = b"pdserve-tenant-salt/v1"
_NAME_LABEL = b"pdserve-tenant-name-salt/v1"  # another label: no key salts as a name does
SALT_CHARS = 32  # hex characters: 128 bits
# Derived salts only: a client's own cache_salt is refused with it (schemas.py).
DERIVED = "@"


def tenant_salt(api_key: bytes) -> str:
    return DERIVED + hmac.new(_LABEL, api_key, sha256).hexdigest()[:SALT_CHARS]


def tenant_name_salt(name: str) -> str:
    return DERIVED + hmac.new(_NAME_LABEL, name.encode(), sha256).hexdigest()[:SALT_CHARS]


def salted(scope: Mapping[str, Any], cache_salt: str | None) -> str | None:
    """The request's salt: its tenant's combined with its own (a hash of both: the same
    own salt under two tenants gives two salts), its own without a tenant."""
    tenant = scope.get(TENANT_SALT)
    if tenant is None:
        return cache_salt
    if cache_salt is None:
        return tenant
    both = blake2b(f"{tenant}\0{cache_salt}".encode(), digest_size=SALT_CHARS // 2)
    return DERIVED + both.hexdigest()
