"""``pdserve bench kv-store`` on a local redis-server it starts itself (tiny sizes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.bench.micro import kv_store
from pdserve.bench.micro.configs import KvStoreConfig


def test_it_measures_every_operation_per_size(tmp_path: Path) -> None:
    out = tmp_path / "kv-store.jsonl"
    config = KvStoreConfig(value_mib=(0.01, 0.5), total_mib=1, batch_mib=1, reps=1,
                           json=str(out))
    assert kv_store.run(config) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ops = ("set", "get", "memcpy", "raw_set", "raw_get")
    assert [(r["value_mib"], r["op"]) for r in rows] == [
        (mib, op) for mib in (0.01, 0.5) for op in ops]
    assert all(r["gib_s"] > 0 and r["tls"] is False for r in rows)
    assert rows[0]["values"] == 1 * 1024 * 1024 // int(0.01 * 1024 * 1024)


def test_bad_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="--value-mib"):
        KvStoreConfig(value_mib=(0,))
    with pytest.raises(ValueError, match="--total-mib"):
        KvStoreConfig(value_mib=(8.0,), total_mib=4)


def test_an_unreachable_url_is_one_error_line(capsys: pytest.CaptureFixture[str]) -> None:
    config = KvStoreConfig(url="redis://127.0.0.1:1", value_mib=(0.01,), total_mib=1, reps=1)
    assert kv_store.run(config) == 1
    assert "pdserve bench kv-store: error:" in capsys.readouterr().err


def test_over_tls_it_measures_the_same_operations(tmp_path: Path) -> None:
    out = tmp_path / "kv-store-tls.jsonl"
    config = KvStoreConfig(value_mib=(0.25,), total_mib=1, batch_mib=1, reps=1,
                           json=str(out), tls=True)
    assert kv_store.run(config) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["op"] for r in rows] == ["set", "get", "memcpy", "raw_set", "raw_get"]
    assert all(r["gib_s"] > 0 and r["tls"] is True for r in rows)
    with pytest.raises(ValueError, match="--tls is for the local server"):
        KvStoreConfig(url="rediss://cache:6380", tls=True)
