"""``pdserve up``'s local servers (etcd, redis-server) kept alive: one that dies is started
again on its port, a failed restart retried after the back-off, and the status table says
which state each is in."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdserve.kv_transfer.remote.local_redis import LocalRedis
from pdserve.launch.up_servers import KeptServer


class FakeServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen[bytes] | None = subprocess.Popen(["true"])
        self.proc.wait()  # dead
        self.url = "redis://127.0.0.1:1"


def test_a_dead_server_is_restarted_and_a_failed_restart_retried_after_the_backoff() -> None:
    server, now, calls = FakeServer(), [100.0], []

    def restart() -> None:
        calls.append(now[0])
        if len(calls) == 1:
            raise RuntimeError("port still taken")
        server.proc = subprocess.Popen(["sleep", "30"])

    kept = KeptServer("redis", server, restart, retry_s=30.0, while_down="misses",
                      clock=lambda: now[0])
    try:
        assert kept.keep() and calls == [100.0]  # at once, and it fails
        assert kept.row() == ("redis", "restarting", "0", "redis://127.0.0.1:1")
        now[0] = 129.0
        assert not kept.keep() and calls == [100.0]  # not before the back-off
        now[0] = 130.0
        assert kept.keep() and calls == [100.0, 130.0]
        assert kept.row() == ("redis", "ready", "1", "redis://127.0.0.1:1")
        assert not kept.keep() and len(calls) == 2  # alive: left alone
    finally:
        if server.proc is not None:
            server.proc.kill()
            server.proc.wait()


def test_a_killed_local_redis_comes_back_on_its_port_with_its_password(
        tmp_path: Path) -> None:
    password_file = tmp_path / "pw"
    password_file.write_text("kept-pass\n")
    server = LocalRedis(maxmemory="16mb", password_file=password_file).start()
    kept = KeptServer("redis", server, server.restart, retry_s=1.0, while_down="misses")
    data_dir = server.data_dir
    try:
        with server.client() as c:
            c.set("k", b"v")
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        assert kept.keep() and kept.restarts == 1
        with server.client() as c:  # same port and password, empty (a cache)
            assert c.ping() and c.get("k") is None
            assert c.config_get("maxmemory") == {"maxmemory": str(16 << 20)}
    finally:
        server.stop()
    assert not data_dir.exists()


def test_a_redis_that_cannot_restart_is_reported_not_raised(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    server = LocalRedis(maxmemory="16mb").start()
    kept = KeptServer("redis", server, server.restart, retry_s=60.0, while_down="misses")
    try:
        assert server.proc is not None
        server.proc.kill()
        server.proc.wait()
        server._argv[server._argv.index("--maxmemory") + 1] = "lots"  # redis-server refuses it
        assert kept.keep() and kept.retry_at is not None and kept.restarts == 0
        assert "redis restart failed" in capsys.readouterr().err
    finally:
        server.stop()
