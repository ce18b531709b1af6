"""``pdserve up`` with etcd: what each child is told, and a clear failure when the
``etcd`` binary is missing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from pdserve.core.process import NotReadyError
from pdserve.launch.up import UpConfig, plan
from pdserve.membership.local_etcd import LocalEtcd


def test_up_with_etcd_url_passes_it_to_every_child(tmp_path: Path) -> None:
    cfg = UpConfig(model="/m", etcd="http://127.0.0.1:2379", cluster="c1", etcd_ttl_s=7)
    children = {c.name: c.argv for c in plan(cfg, tmp_path)}
    assert set(children) == {"prefill-0", "decode-0", "router"}
    for argv in children.values():
        i = argv.index("--etcd")
        assert argv[i:i + 6] == ["--etcd", "http://127.0.0.1:2379", "--cluster", "c1",
                                 "--etcd-ttl-s", "7"]
    assert "--prefill" not in children["router"] and "--decode" not in children["router"]


def test_up_static_names_the_workers(tmp_path: Path) -> None:
    children = {c.name: c.argv for c in plan(UpConfig(model="/m"), tmp_path)}
    assert "--etcd" not in children["router"] and "--decode" in children["router"]


def test_etcd_and_with_etcd_are_exclusive() -> None:
    with pytest.raises(ValueError, match="not both"):
        UpConfig(model="/m", etcd="http://x:1", with_etcd=True)


def test_with_etcd_fails_clearly_without_the_binary(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="apt-get install etcd-server"):
        LocalEtcd()


def test_local_etcd_starts_and_stops_cleanly() -> None:
    etcd = LocalEtcd().start()
    data_dir = etcd.data_dir
    assert etcd.proc is not None and etcd.proc.poll() is None
    etcd.stop()
    assert etcd.proc is None and not data_dir.exists()


def test_local_etcd_that_fails_to_start_leaves_no_data_directory() -> None:
    """Its client port taken, etcd exits at once: no ``with`` block will stop it."""
    etcd = LocalEtcd()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", etcd.client_port))
        taken.listen()
        with pytest.raises(NotReadyError, match="exit code"):
            etcd.start()
    assert etcd.proc is None and not etcd.data_dir.exists()
