"""The Redis a deploy file describes (the chart's StatefulSet, compose's service), run
from its own ``/bin/sh -c`` script on the local redis-server, so that what the container
would run shows here. Only what a single host forces is substituted: the container's
password file → a local one, a free port on 127.0.0.1 and a temp data folder (compose's
``$$`` is the shell's ``$``)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from pdserve.core import process
from pdserve.core.ports import free_port


def localize(script: str, password_file: str, local_file: Path, port: int,
             data_dir: Path) -> str:
    """``script`` (a server's command or a probe) as it runs on this machine."""
    text = script.replace("$$", "$").replace(password_file, str(local_file))
    text = text.replace(" --dir /data ", " ")
    text = text.replace("redis-server - ", f"redis-server - --port {port} --bind 127.0.0.1 "
                                           f"--dir {data_dir} ")
    return text.replace("redis-cli ping", f"redis-cli -p {port} ping")


@contextmanager
def running_redis(script: str, password_file: str, password: str, tmp_path: Path
                  ) -> Iterator[tuple[int, Path]]:
    """The server ``script`` starts, with ``password`` in its password file: yields its
    port and the local password file (rewrite it to test a probe); stopped after."""
    local_file = tmp_path / "redis-password"
    local_file.write_text(password + "\n")
    port = free_port()
    data_dir = tmp_path / "redis-data"
    data_dir.mkdir()
    proc = process.spawn(["/bin/sh", "-c", localize(script, password_file, local_file, port,
                                                    data_dir)],
                         log_path=tmp_path / "redis.log")
    client = redis.Redis(port=port, password=password, socket_timeout=1)
    try:
        process.wait_ready(lambda: "" if client.ping() else "no PONG", 10,
                           exited=lambda: None if proc.poll() is None else "exited",
                           interval_s=0.05)
        yield port, local_file
    finally:
        client.close()
        process.stop([proc], grace_s=5)


def probe_passes(probe: str, password_file: str, local_file: Path, port: int) -> bool:
    """Whether a ``/bin/sh -c`` probe of the server exits 0."""
    check = localize(probe, password_file, local_file, port, local_file.parent)
    return subprocess.run(["/bin/sh", "-c", check], timeout=10).returncode == 0


def server_settings(port: int, password: str) -> dict[str, str]:
    """What the server says its cache settings are (and that it wants a password)."""
    with redis.Redis(port=port, socket_timeout=1) as anonymous:
        try:
            anonymous.ping()
            auth = "none"
        except redis.AuthenticationError:
            auth = "required"
    settings = {"auth": auth}
    with redis.Redis(port=port, password=password, socket_timeout=1) as c:
        for name in ("maxmemory", "maxmemory-policy", "save", "appendonly"):
            settings.update(c.config_get(name))
    return settings
