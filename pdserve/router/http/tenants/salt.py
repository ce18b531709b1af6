"""Tenant isolation by API key (``--tenant-isolation key``): each key is a tenant, and
every request it authenticates is salted with ``tenant_salt(secret, key)``, an HMAC of
the key (never the key) keyed by the cluster secret (``--cluster-secret-file``),
combined with the request's own ``cache_salt`` if it sent one, never
replaced by it. Keys that name one tenant in the key table (``table.py``) are that
one tenant: their requests are salted with ``tenant_name_salt(secret, name)``, so the tenant's
cache survives adding or rotating its keys. Requests under different salts share no
cached KV anywhere in the cluster (``core.block_hash.salt_root``, vLLM's own
``cache_salt``), and so no cached-token count or prompt-cache timing difference tells one
tenant what another sent.

A client cannot reach another tenant's salt by its own ``cache_salt``: under isolation
its own salt is always hashed with its tenant's (``salted``); and every salt derived
here starts with ``@``, which a client's own salt may not hold (vLLM's rule, a 400), so
even through a router without isolation on the same workers, no client salt equals a
tenant's. Keyed by the cluster secret, a salt cannot be computed by whoever knows a
tenant's name (on ``/metrics``) and this file: not by a client, nor by a process that
reads the workers' block names (gRPC, KV), so none can test whether a tenant sent a
guessed prompt. Every router process and replica of a cluster holds the same secret, so
they all derive the same salts (a tenant's prefixes are shared across them); without a
secret ``--tenant-isolation key`` is refused at start (``server.RouterConfig``).
``ApiKeyMiddleware`` puts the salt in the request's ASGI scope
(``TENANT_SALT``) once the key matched; the endpoints fold it into the body
(``salted``)."""

from __future__ import annotations

from collections.abc import Mapping
from hashlib import blake2b
from typing import Any

from pdserve.core.cluster_secret import ClusterSecret

TENANT_SALT = "pdserve.tenant_salt"  # the ASGI scope key
# The labels of ClusterSecret.mac (label NUL key): the salt is a one-way function of the
# API key (or name) that every router replica computes the same, and that no one without
# the cluster secret can compute. v2: keyed by the secret (v1 was keyed by the label).
_LABEL = b"pdserve-tenant-salt/v2"
_NAME_LABEL = b"pdserve-tenant-name-salt/v2"  # another label: no key salts as a name does
SALT_CHARS = 32  # hex characters: 128 bits
# Derived salts only: a client's own cache_salt is refused with it (schemas.py).
DERIVED = "@"


def tenant_salt(secret: ClusterSecret, api_key: bytes) -> str:
    return DERIVED + secret.mac(_LABEL, api_key).hex()[:SALT_CHARS]


def tenant_name_salt(secret: ClusterSecret, name: str) -> str:
    return DERIVED + secret.mac(_NAME_LABEL, name.encode()).hex()[:SALT_CHARS]


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
