"""``--tenant-isolation key``: every request an API key authenticates is salted with an
HMAC of that key (never the key) keyed by the cluster secret, combined with the request's
own ``cache_salt``;
``off``: the request's own salt alone. What the dispatcher is asked for is checked on a
scripted dispatcher; that a salt isolates cached KV, in ``test_decode_cache.py`` (simulated
workers) and ``test_openai_surface.py`` (vLLM)."""

from __future__ import annotations

import hmac
from hashlib import sha256
from typing import Any

import pytest
from unit.fakes import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    ROUTER_SECRET,
    FakeDispatcher,
    asgi_http_client,
    chat_body,
    cmpl_body,
    make_router_app,
)

from pdserve.cli.configs import HANDED_TO_ROUTER, edge_config, handed_on
from pdserve.cli.parser import build_parser
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.tenants.accounts import tenant_accounts
from pdserve.router.http.tenants.salt import tenant_name_salt, tenant_salt
from pdserve.router.server import RouterConfig

KEYS = ("tenant-a-key-1234", "tenant-b-key-5678")


async def salts(tokenizer: Any, isolation: str, requests: list[tuple[str, str, dict[str, Any]]],
                secret: ClusterSecret = ROUTER_SECRET) -> list[str | None]:
    """The cache salt the dispatcher got for each (key, path, body)."""
    dispatcher = FakeDispatcher(output_ids=[5, 6])
    app = make_router_app(tokenizer, dispatcher,
                          EdgeConfig(api_keys=KEYS, tenant_isolation=isolation), secret=secret)
    async with asgi_http_client(app) as client:
        for key, path, body in requests:
            reply = await client.post(path, json=body,
                                      headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
    return [call.sampling.cache_salt for call in dispatcher.calls]


async def test_each_key_is_a_tenant_with_a_salt_of_its_own(tokenizer: Any) -> None:
    a, b = KEYS
    got = await salts(tokenizer, "key", [
        (a, COMPLETIONS, cmpl_body()), (a, CHAT_COMPLETIONS, chat_body()),
        (b, COMPLETIONS, cmpl_body()),
        (a, COMPLETIONS, cmpl_body(cache_salt="shared")),
        (b, COMPLETIONS, cmpl_body(cache_salt="shared"))])
    salt_a, salt_a_chat, salt_b, own_a, own_b = got
    assert salt_a == salt_a_chat and salt_a is not None and salt_b is not None
    assert salt_a != salt_b
    assert all(k not in s for s in (salt_a, salt_b) for k in KEYS)  # a hash, never the key
    # A request's own salt is combined with its tenant's, never replaces it.
    assert len({salt_a, salt_b, own_a, own_b, "shared"}) == 5
    # Every derived salt is in a namespace no client's own salt may enter (``@``: a 400).
    assert own_a is not None and own_b is not None
    assert all(s.startswith("@") for s in (salt_a, salt_b, own_a, own_b))
    # The same on another router (a replica): a tenant's salt does not depend on the process.
    again = await salts(tokenizer, "key", [(a, COMPLETIONS, cmpl_body())])
    assert again == [salt_a]


async def test_a_tenants_salt_is_keyed_by_the_cluster_secret(tokenizer: Any) -> None:
    """Who knows a key (or a tenant's name) and the derivation but not the cluster
    secret cannot compute the salt, hence not the tenant's block names: another
    secret gives other salts, and the salt is not the old public-label HMAC."""
    a = KEYS[0]
    ours = await salts(tokenizer, "key", [(a, COMPLETIONS, cmpl_body())])
    other = await salts(tokenizer, "key", [(a, COMPLETIONS, cmpl_body())],
                        secret=ClusterSecret(b"another-cluster-secret-98765"))
    public = "@" + hmac.new(b"pdserve-tenant-salt/v1", a.encode(), sha256).hexdigest()[:32]
    assert ours != other and public not in (*ours, *other)
    assert ours == [tenant_salt(ROUTER_SECRET, a.encode())]
    assert tenant_name_salt(ROUTER_SECRET, "acme") != tenant_name_salt(
        ClusterSecret(b"another-cluster-secret-98765"), "acme")


def test_tenant_isolation_without_a_cluster_secret_is_refused_at_start() -> None:
    edge = EdgeConfig(api_keys=KEYS, tenant_isolation="key")
    with pytest.raises(ValueError, match="--tenant-isolation key needs --cluster-secret-file"):
        RouterConfig("m", "m", ("p:1",), ("d:1",), edge=edge)
    with pytest.raises(ValueError, match="--cluster-secret-file"):
        tenant_accounts(edge, None, None)


async def test_without_isolation_only_the_requests_own_salt_counts(tokenizer: Any) -> None:
    a, b = KEYS
    got = await salts(tokenizer, "off", [
        (a, COMPLETIONS, cmpl_body()), (b, COMPLETIONS, cmpl_body(cache_salt="mine"))])
    assert got == [None, "mine"]


def test_tenant_isolation_needs_keys_and_reaches_the_router_from_flags() -> None:
    with pytest.raises(ValueError, match="needs API keys"):
        EdgeConfig(tenant_isolation="key")
    args = build_parser().parse_args(["router", "--decode", "c:3", "--api-key", KEYS[0],
                                      "--tenant-isolation", "key"])
    edge = edge_config(args)
    assert edge.tenant_isolation == "key"
    handed = handed_on(args, HANDED_TO_ROUTER)  # what up hands its router
    assert handed[handed.index("--tenant-isolation") + 1] == "key"
    assert build_parser().parse_args(["router", "--decode", "c:3"]).tenant_isolation == "off"
