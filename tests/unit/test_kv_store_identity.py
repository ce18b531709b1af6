"""A worker's store identity from its registered KV caches: every layout change, TP rank
and salt gives other keys; the same layout on another device the same ones. An engine's
identity (``engine_identity``, what the connector names blocks by) covers its KV format:
the attention backend, vLLM's resolved KV cache layout (NHD/HND...), the attention spec,
the device; two formats differing in any field never share a block."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
)

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote import engine_identity as engine_identity_module
from pdserve.kv_transfer.remote import setup as store_setup
from pdserve.kv_transfer.remote.engine_identity import engine_identity
from pdserve.kv_transfer.remote.identity import identity_for, with_salt
from pdserve.kv_transfer.remote.kv_format import KVFormat, attention_backend, describe_spec
from pdserve.kv_transfer.remote.names import KVIdentity

BLOCKS = 6


def _identity(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, layers: int = 2,
              block_size: int = 16, tp_rank: int = 0, tp_size: int = 1,
              compression: str = "none") -> KVIdentity:
    caches = {f"layer.{i}": torch.zeros(shape, dtype=dtype) for i in range(layers)}
    layout = KVLayout.from_kv_caches(caches, BLOCKS, block_size)
    return identity_for(layout, model_fingerprint="fp", weight_version="default",
                        tp_rank=tp_rank, tp_size=tp_size, compression=compression)


CPU = (BLOCKS, 2, 16, 128)  # (blocks, heads, tokens, 2 * head_dim)


def test_the_layout_names_dtype_shape_block_dim_and_rank() -> None:
    base = _identity(CPU)
    assert base.kv_dtype == "float32" and base.block_size == 16
    assert base.block_shape == (2, 2, 16, 128)
    others = [_identity(CPU, torch.bfloat16), _identity((BLOCKS, 4, 16, 64)),
              _identity((2, BLOCKS, 16, 2, 64)), _identity((BLOCKS, 2, 16, 64, 2)),
              _identity(CPU, layers=3), _identity(CPU, block_size=32),
              _identity(CPU, tp_rank=1, tp_size=2), _identity(CPU, tp_rank=0, tp_size=2),
              with_salt(base, "tenant-a"), with_salt(base, ""),
              *(_identity(CPU, compression=c) for c in ("lossless", "int8", "fp8"))]
    keys = {ident.names([7])[0].key for ident in [base, *others]}
    assert len(keys) == 1 + len(others)
    assert _identity(CPU).names([7])[0].key == base.names([7])[0].key  # deterministic


def test_the_codec_is_part_of_the_identity() -> None:
    assert _identity(CPU).kv_encoding == "none"
    assert _identity(CPU, compression="int8").kv_encoding == "int8.v1"
    with pytest.raises(ValueError, match="unknown KV compression"):
        _identity(CPU, compression="zip")


def test_a_rank_outside_the_group_is_refused() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        _identity(CPU, tp_rank=2, tp_size=2)


# ---- the engine's KV format (kv_format.py, engine_identity.py) -------------------------

TOKEN = st.text(min_size=1, max_size=10)
FORMAT = st.builds(KVFormat, device=TOKEN, attention_backend=TOKEN, cache_layout=TOKEN,
                   spec=st.text(max_size=30), num_tensors=st.integers(1, 64),
                   block_bytes=st.integers(1, 1 << 24), tp_size=st.integers(1, 8),
                   vllm=TOKEN)
FORMAT_FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "device": TOKEN, "attention_backend": TOKEN, "cache_layout": TOKEN,
    "spec": st.text(max_size=30), "num_tensors": st.integers(1, 64),
    "block_bytes": st.integers(1, 1 << 24), "tp_size": st.integers(1, 8), "vllm": TOKEN}


def test_every_format_field_is_drawn() -> None:
    assert sorted(FORMAT_FIELDS) == sorted(f.name for f in dataclasses.fields(KVFormat))


@given(FORMAT, st.integers(0, 2**64 - 1), st.data())
def test_kv_formats_differing_in_any_field_never_share_a_block(
        fmt: KVFormat, block_hash: int, data: st.DataObject) -> None:
    """Two engines whose KV layout differs in anything (backend, vLLM's cache layout,
    the attention spec, ...) never name one block alike, whatever the rest."""
    field = data.draw(st.sampled_from(sorted(FORMAT_FIELDS)))
    old = getattr(fmt, field)
    other = dataclasses.replace(
        fmt, **{field: data.draw(FORMAT_FIELDS[field].filter(lambda v: v != old))})
    a, b = (KVIdentity("fp", "default", "float32", f.name(), 16) for f in (fmt, other))
    assert a.names([block_hash])[0].key != b.names([block_hash])[0].key


def _engine(layout: str | None = "LBNHC", heads: int = 2, head_size: int = 64,
            dtype: torch.dtype = torch.float32, device: str = "cpu",
            block_size: int = 16) -> tuple[Any, Any]:
    """A fake vLLM config and a real KV cache config of one full-attention group."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size,
                             dtype=dtype)
    page = spec.page_size_bytes
    config = SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
        cache_config=SimpleNamespace(block_size=block_size, kv_cache_layout=None,
                                     cache_dtype="auto"),
        model_config=SimpleNamespace(model="/nonexistent/pdserve-model", dtype=dtype,
                                     use_mla=False),
        device_config=SimpleNamespace(device_type=device),
        attention_config=SimpleNamespace(backend=None))
    kv_cache = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[
            KVCacheTensor(size=page * BLOCKS, layers=[f"l{i}"], layer_stride=page * BLOCKS,
                          block_stride=page) for i in range(2)],
        kv_cache_groups=[KVCacheGroupSpec(["l0", "l1"], spec)], kv_cache_layout=layout)
    return config, kv_cache


def _key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, backend: str = "CPU_ATTN",
         **engine: Any) -> str:
    monkeypatch.setattr(engine_identity_module, "attention_backend",
                        lambda config, head_size: backend)
    config, kv_cache = _engine(**engine)
    ident = engine_identity(config, kv_cache, "none", str(tmp_path))
    return ident.names([7])[0].key


def test_the_engine_identity_names_the_backend_the_cache_layout_and_the_spec(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    base = _key(monkeypatch, tmp_path)
    others = [_key(monkeypatch, tmp_path, backend="FLASH_ATTN"),
              _key(monkeypatch, tmp_path, backend="FLASHINFER"),
              _key(monkeypatch, tmp_path, layout="LBHNC"),  # HND, not NHD
              _key(monkeypatch, tmp_path, layout=None),  # unresolved
              _key(monkeypatch, tmp_path, heads=4, head_size=32),  # same bytes per block
              _key(monkeypatch, tmp_path, dtype=torch.bfloat16),
              _key(monkeypatch, tmp_path, device="cuda"),
              _key(monkeypatch, tmp_path, block_size=32)]
    assert len({base, *others}) == 1 + len(others)
    assert _key(monkeypatch, tmp_path) == base  # deterministic


def test_without_a_selector_answer_the_store_is_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A guessed backend name could let two layouts of one shape share blocks: where
    vLLM's selector cannot answer, neither side of the connector has a store."""
    config, kv_cache = _engine()  # a fake config: vLLM's selector cannot answer for it
    assert attention_backend(config, 64) is None
    connector = ConnectorConfig(engine_id="e", kv_store="redis://127.0.0.1:1")
    assert store_setup.store_planner(connector, config, kv_cache) is None
    assert store_setup.store_worker(connector, config, kv_cache) is None
    monkeypatch.setattr(store_setup, "attention_backend", lambda config, head_size: "CPU_ATTN")
    assert store_setup.store_planner(connector, config, kv_cache) is not None  # the control


def test_a_spec_is_described_with_every_field() -> None:
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    text = describe_spec(spec)
    assert text.startswith("FullAttentionSpec(") and "num_kv_heads=2" in text
    assert "head_size=64" in text and "torch.float16" in text
    assert describe_spec(dataclasses.replace(spec, head_size_v=32)) != text


def test_the_checkpoint_hashes_live_in_the_pdserve_cache_or_nowhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker with a store and no disk tier keeps its checkpoint hashes in
    ``<PDSERVE_CACHE>/kv-store`` (0700); where that cannot be made, in no folder at all:
    it used to fall back to the shared temporary folder, where another user could
    plant them."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    folder = engine_identity_module._cache_dir()
    assert folder == str(tmp_path / "cache" / "kv-store")
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "a-file" / "cache"))
    assert engine_identity_module._cache_dir() is None
