"""The disk tier's files are the owner's only, and its folder is named by the weights'
content (``tiers/fingerprint.py``): a checkpoint overwritten in place under the same path
finds none of the old KV after a restart, while an unchanged one is found again without
hashing its files twice."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.kv_transfer.connector import disk_folder
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.tiers import fingerprint
from pdserve.kv_transfer.tiers.disk import DiskTier, scan
from pdserve.kv_transfer.tiers.fingerprint import SIDECAR, checkpoint_fingerprint

WEIGHTS = "model-00001-of-00001.safetensors"


def _h(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _tier(root: Path, compat: str) -> DiskTier:
    kv = {f"layer.{i}": torch.randn(6, 3, 16, 8) for i in range(2)}
    return DiskTier(root, compat, list(kv.values()), KVLayout.from_kv_caches(kv, 6, 16))


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _vllm_config(model: Path) -> Any:
    return SimpleNamespace(
        model_config=SimpleNamespace(model=str(model), served_model_name="m",
                                     dtype=torch.float32),
        cache_config=SimpleNamespace(block_size=16),
        parallel_config=SimpleNamespace(tensor_parallel_size=1))


def _restart() -> None:
    """What a new process starts with: no fingerprint cached in memory."""
    fingerprint._fingerprint.cache_clear()


@pytest.fixture
def model(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"hidden_size": 8}')
    (folder / WEIGHTS).write_bytes(b"\x01" * 4096)
    _restart()
    return folder


def test_block_files_are_0600_in_a_0700_folder(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a umask that would leave them world-readable
    try:
        tier = _tier(tmp_path / "disk", "model-a")
        stale = tier.path(1).with_suffix(".tmp")
        stale.write_bytes(b"left by a crash")
        stale.chmod(0o644)
        tier.save([1, 2], [0, 1], [_h(1), _h(2)])
    finally:
        os.umask(old)
    assert [_mode(tier.path(s)) for s in (0, 1)] == [0o600, 0o600]
    assert _mode(tier.folder) == 0o700
    assert _mode(tmp_path / "disk") == 0o700


def test_an_open_folder_from_before_is_closed_at_start(tmp_path: Path) -> None:
    (tmp_path / "model-a").mkdir(mode=0o755)
    (tmp_path / "model-a").chmod(0o755)
    assert _mode(_tier(tmp_path, "model-a").folder) == 0o700


def test_weights_overwritten_in_place_find_no_old_block(tmp_path: Path, model: Path) -> None:
    disk = tmp_path / "disk"
    before = disk_folder(_vllm_config(model), 1024, 2, str(disk))
    _tier(disk, before).save([1], [0], [_h(1)])
    assert scan(disk, before, 4) == [(0, _h(1))]

    # Same path, same size, the old mtime put back: only the bytes differ.
    path = model / WEIGHTS
    st = path.stat()
    path.write_bytes(b"\x02" * 4096)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    _restart()
    after = disk_folder(_vllm_config(model), 1024, 2, str(disk))
    assert after != before
    assert scan(disk, after, 4) == []  # no hit: the old KV is never read

    _restart()  # and a restart with these weights unchanged finds its own folder again
    assert disk_folder(_vllm_config(model), 1024, 2, str(disk)) == after


def test_a_restart_reads_the_sidecar_instead_of_hashing_again(
        tmp_path: Path, model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[int] = []
    real = hashlib.sha256

    def counting(*args: Any) -> Any:
        hashed.append(1)
        return real(*args)

    first = checkpoint_fingerprint(str(model), tmp_path / "disk")
    assert _mode(tmp_path / "disk" / SIDECAR) == 0o600
    assert checkpoint_fingerprint(str(model), tmp_path / "disk") == first  # in memory
    _restart()
    monkeypatch.setattr(fingerprint.hashlib, "sha256", counting)
    assert checkpoint_fingerprint(str(model), tmp_path / "disk") == first
    assert len(hashed) == 1  # the total only: no file was read again
    (model / "config.json").write_text('{"hidden_size": 16}')
    _restart()
    hashed.clear()
    assert checkpoint_fingerprint(str(model), tmp_path / "disk") != first
    assert len(hashed) == 2  # the changed file and the total


def test_a_model_without_local_files_is_keyed_by_its_name(tmp_path: Path) -> None:
    _restart()
    assert checkpoint_fingerprint("no-such-org/no-such-model-xyz", tmp_path) == ""


def test_block_folders_an_older_pdserve_left_open_are_closed_and_the_root_is_left(
        tmp_path: Path) -> None:
    root = tmp_path / "kv"
    old = root / "old-weights"
    old.mkdir(parents=True)
    (old / "0.kv").write_bytes(b"a prompt's kv")
    other = root / "not-ours"
    other.mkdir()
    (other / "notes.txt").write_text("x")
    for path, mode in ((root, 0o755), (old, 0o755), (other, 0o755)):
        os.chmod(path, mode)
    _tier(root, "new-weights")
    assert _mode(old) == 0o700  # its 0644 files cannot be reached through it any more
    assert _mode(root / "new-weights") == 0o700
    assert _mode(root) == 0o755 and _mode(other) == 0o755  # not ours to change


def test_the_sidecar_is_written_through_a_fresh_file_never_a_link_planted_there(
        tmp_path: Path, model: Path) -> None:
    """The temporary file the sidecar is written through once had a name anyone could
    guess (``checkpoints.json.<pid>.tmp``): a link planted at it sent the write into
    the file it pointed at."""
    disk = tmp_path / "disk"
    disk.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("untouched")
    (disk / f"{SIDECAR}.{os.getpid()}.tmp").symlink_to(victim)
    checkpoint_fingerprint(str(model), disk)
    assert victim.read_text() == "untouched"
    assert _mode(disk / SIDECAR) == 0o600 and str(model / WEIGHTS) in (
        disk / SIDECAR).read_text()
    assert sorted(p.name for p in disk.iterdir()) == sorted(
        [SIDECAR, f"{SIDECAR}.{os.getpid()}.tmp"])  # no temporary file left


def test_without_a_folder_for_the_sidecar_every_file_is_hashed_and_nothing_written(
        tmp_path: Path, model: Path) -> None:
    with_sidecar = checkpoint_fingerprint(str(model), tmp_path / "disk")
    _restart()
    before = sorted(tmp_path.rglob("*"))
    assert checkpoint_fingerprint(str(model), None) == with_sidecar
    assert sorted(tmp_path.rglob("*")) == before
