"""The name a worker gives the router for its cluster KV store (``--kv-store``).

Workers that name the same store load each other's published blocks, so the router
counts a block one of them announced to the store as loadable on every one of them
(``router/dispatch/prefix/routing.py``). The name is a hash of where the store is
(scheme, hosts and ports, database path), never the URL itself: the user name, any
password and any query (options) are left out, and no part of the URL leaves the
worker in clear.
"""

from __future__ import annotations

from hashlib import sha256
from urllib.parse import urlsplit


def kv_store_id(url: str | None) -> str:
    """The store's name for the router ("" without a store)."""
    if not url:
        return ""
    parts = urlsplit(url.strip())
    hosts = parts.netloc.rpartition("@")[2].lower()  # no user name, no password
    where = f"{parts.scheme.lower()}://{','.join(sorted(hosts.split(',')))}{parts.path}"
    return sha256(b"pdserve-kv-store:" + where.encode()).hexdigest()[:16]
