"""The cluster KV store's block identity, value format and URL registry (no server)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.kv_transfer.remote import codec
from pdserve.kv_transfer.remote.base import StoreOptions, create_store, store_schemes
from pdserve.kv_transfer.remote.names import KEY_PREFIX, BlockName, KVIdentity

U64 = st.integers(min_value=0, max_value=2**64 - 1)
TEXT = st.text(max_size=12)
IDENTITY = st.builds(
    KVIdentity, model_fingerprint=TEXT, weight_version=TEXT, kv_dtype=TEXT, kv_layout=TEXT,
    block_size=st.integers(min_value=1, max_value=4096),
    block_shape=st.lists(st.integers(min_value=0, max_value=512), max_size=4).map(tuple),
    cache_salt=st.none() | TEXT, adapter=st.none() | TEXT, kv_encoding=TEXT)
IDENTITY_FIELDS = [f.name for f in dataclasses.fields(KVIdentity)]


# each identity field's values: a draw for the field that differs from the name's
FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "model_fingerprint": TEXT, "weight_version": TEXT, "kv_dtype": TEXT, "kv_layout": TEXT,
    "block_size": st.integers(min_value=1, max_value=4096),
    "block_shape": st.lists(st.integers(0, 512), max_size=4).map(tuple),
    "cache_salt": st.none() | TEXT, "adapter": st.none() | TEXT, "kv_encoding": TEXT}


def test_every_identity_field_is_covered() -> None:
    assert sorted(FIELD_VALUES) == sorted(IDENTITY_FIELDS)


@given(IDENTITY, U64, U64, st.data())
def test_names_differing_in_any_identity_field_never_share_a_key(
        ident: KVIdentity, block_hash: int, root: int, data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(IDENTITY_FIELDS))
    old = getattr(ident, field)
    value = data.draw(FIELD_VALUES[field].filter(lambda v: v != old))
    changed = dataclasses.replace(ident, **{field: value})
    a, b = BlockName(ident, block_hash, root), BlockName(changed, block_hash, root)
    assert a.key != b.key
    assert a.key.startswith(KEY_PREFIX) and b.key.startswith(KEY_PREFIX)


@given(IDENTITY, U64, U64, U64, U64)
def test_names_differing_in_the_hashes_never_share_a_key(
        ident: KVIdentity, h1: int, h2: int, r1: int, r2: int) -> None:
    same = (h1, r1) == (h2, r2)
    assert (BlockName(ident, h1, r1).key == BlockName(ident, h2, r2).key) == same


@given(IDENTITY, st.lists(U64, min_size=1, max_size=8))
def test_a_prompts_blocks_share_one_hash_tag(ident: KVIdentity, hashes: list[int]) -> None:
    tags = {name.key[len(KEY_PREFIX):].split("}")[0] for name in ident.names(hashes)}
    assert len(tags) == 1


def test_none_and_empty_salt_are_different_tenants() -> None:
    base = KVIdentity("fp", "default", "bfloat16", "cpu", 16)
    salted = dataclasses.replace(base, cache_salt="")
    assert BlockName(base, 1, 1).key != BlockName(salted, 1, 1).key


@given(st.binary(max_size=4096), st.text(max_size=20))
def test_codec_round_trips_bit_exact(payload: bytes, key: str) -> None:
    decoded = codec.decode(key, codec.encode(key, payload))
    assert decoded is not None and bytes(decoded) == payload


@given(st.binary(min_size=1, max_size=512), st.data())
def test_codec_refuses_a_flipped_byte_a_cut_or_another_key(payload: bytes,
                                                           data: st.DataObject) -> None:
    value = bytearray(codec.encode("k", payload))
    at = data.draw(st.integers(0, len(value) - 1))
    value[at] ^= 1 << data.draw(st.integers(0, 7))
    assert codec.decode("k", bytes(value)) is None
    good = codec.encode("k", payload)
    assert codec.decode("k", good[:-1]) is None
    assert codec.decode("other", good) is None


def test_an_unknown_scheme_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="redis://, redis-cluster://, rediss://, "
                                         "rediss-cluster://"):
        create_store("memcached://127.0.0.1:11211")
    assert store_schemes() == ["redis", "redis-cluster", "rediss", "rediss-cluster"]


def test_a_bad_cluster_url_and_bad_options_are_refused() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        create_store("redis-cluster://127.0.0.1:1,nohost")
    with pytest.raises(ValueError, match="timeout_s"):
        StoreOptions(timeout_s=0)
    with pytest.raises(ValueError, match="block_size"):
        KVIdentity("fp", "default", "bfloat16", "cpu", 0)
