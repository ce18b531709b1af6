"""Benches that start processes keep their logs in ``<cache>/logs/bench-<name>-*``, never
in the system temporary folder (router-cost's parts and metrics-overhead left a folder
there per run, and the auth run its cluster secret in it); a run's cluster secret lives
only while its processes do."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdserve.bench.micro.router_cost.parts import secret_file_for
from pdserve.core.cluster_secret import load_cluster_secret
from pdserve.core.model import new_log_dir


def test_each_run_gets_its_own_folder_under_the_caches_logs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    first, second = new_log_dir("bench-router-stream-"), new_log_dir("bench-router-stream-")
    assert first != second and first.is_dir() and second.is_dir()
    assert first.parent == tmp_path / "cache" / "logs"
    assert first.name.startswith("bench-router-stream-")


def test_a_runs_secret_is_a_private_file_gone_after_the_run() -> None:
    with secret_file_for("secret") as path:
        assert path is not None
        assert load_cluster_secret(path) is not None
        assert stat.S_IMODE(Path(path).stat().st_mode) & 0o077 == 0
    assert not Path(path).exists() and not Path(path).parent.exists()
    with secret_file_for("none") as nothing:
        assert nothing is None
