"""The LoRA adapter is part of every cache key: the same prompt under two adapters, or
under an adapter and the base model, never shares a block name in the router's prefix
index, a KV tier's (and so the pool's) namespace, the cluster store's keys, or the
names the workers' KV events translate to."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.core.block_hash import (
    KV_TIERS,
    chain_hashes,
    salt_root,
    tier_hashes,
    versioned_salt,
)
from pdserve.core.lora import LoraAdapter, adapter_salt, split_adapter_salt
from pdserve.kv_transfer.remote.engine_identity import for_request
from pdserve.kv_transfer.remote.names import KVIdentity
from pdserve.worker.vllm.kv_events import VllmEventTranslator

BS = 16
IDENTITY = KVIdentity(model_fingerprint="f", weight_version="default", kv_dtype="float32",
                      kv_layout="cpu", block_size=BS)
A = LoraAdapter("sql", "/adapters/sql")
B = LoraAdapter("chat", "/adapters/chat")
A_REFIT = LoraAdapter("sql", "/adapters/sql-step-2")  # same name, new folder
ADAPTERS = (None, A, B, A_REFIT)

prompts = st.lists(st.integers(0, 49_151), min_size=BS, max_size=6 * BS)
salts = st.one_of(st.none(), st.text(alphabet="abcxyz-", min_size=1, max_size=8))
versions = st.sampled_from(["default", "step-7"])


def salt_of(salt: str | None, adapter: LoraAdapter | None, version: str) -> str | None:
    """As the router and the worker both build it: adapter first, then the version."""
    return versioned_salt(adapter_salt(salt, adapter), version)


def index_names(prompt: list[int], salt: str | None) -> set[int]:
    return set(chain_hashes(prompt, BS, salt_root(salt)))


@settings(max_examples=60, deadline=None)
@given(prompt=prompts, salt=salts, version=versions)
def test_no_block_name_is_shared_across_adapters(prompt: list[int], salt: str | None,
                                                 version: str) -> None:
    salted = [salt_of(salt, a, version) for a in ADAPTERS]
    assert len(set(salted)) == len(ADAPTERS)
    index = [index_names(prompt, s) for s in salted]
    tiers = [{h for tier in KV_TIERS for h in tier_hashes(sorted(names), tier)}
             for names in index]
    store = [{n.key for n in for_request(IDENTITY, s).names(sorted(names))}
             for s, names in zip(salted, index, strict=True)]
    for kind in (index, tiers, store):
        for i in range(len(ADAPTERS)):
            for j in range(i + 1, len(ADAPTERS)):
                assert not kind[i] & kind[j], (ADAPTERS[i], ADAPTERS[j])


@given(salt=salts, version=versions)
def test_the_store_identity_names_the_adapter_the_tenant_and_the_version(
        salt: str | None, version: str) -> None:
    for adapter in ADAPTERS:
        ident = for_request(IDENTITY, salt_of(salt, adapter, version))
        assert ident.adapter == (None if adapter is None else adapter.tag)
        assert ident.cache_salt == salt and ident.weight_version == version
    assert split_adapter_salt(adapter_salt(salt, A)) == (salt, A.tag)


def test_kv_events_of_an_adapter_translate_to_the_routers_names() -> None:
    """vLLM's event puts the LoRA name first in the first block's extra keys, then the
    salt (``to_event_extra_keys``): the translator chains from the salt, as the router."""
    from vllm.distributed.kv_events import BlockStored

    prompt = list(range(100, 100 + 3 * BS))
    for adapter in (A, B):
        salt = salt_of(None, adapter, "default")
        stored = BlockStored(
            block_hashes=[b"h0", b"h1", b"h2"], parent_block_hash=None, token_ids=prompt,
            block_size=BS, lora_id=1, lora_name=adapter.name, medium="CPU",
            extra_keys=[(adapter.name, salt), (adapter.name,), (adapter.name,)])
        _, names, _ = VllmEventTranslator(BS).translate([stored])
        assert names == chain_hashes(prompt, BS, salt_root(salt))
        assert not set(names) & index_names(prompt, None)
