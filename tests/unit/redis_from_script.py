"""The Redis a deploy file describes (the chart's StatefulSet, compose's service), run
from its own ``/bin/sh -c`` script on the local redis-server, so that what the container
would run shows here. Only what a single host forces is substituted: the container's
password file → a local one, a free port on 127.0.0.1 and a temp data folder (compose's
``$$`` is the shell's ``$``); under TLS its certificate files → local ones (``tls``: the
container's path of each of a ``TlsFiles``' cert, key and CA)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from pdserve.core import process
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.ports import free_port

# the container's certificate paths of a TlsFiles (cert, key, ca) -> where they are here
TlsPaths = Mapping[str, str]


def localize(script: str, password_file: str, local_file: Path, port: int,
             data_dir: Path, tls: TlsPaths | None = None) -> str:
    """``script`` (a server's command or a probe) as it runs on this machine."""
    text = script.replace("$$", "$").replace(password_file, str(local_file))
    for container_path, local_path in (tls or {}).items():
        text = text.replace(container_path, local_path)
    text = text.replace(" --dir /data ", " ")
    text = text.replace("--tls-port 6379", f"--tls-port {port}")  # its --port 0 comes later
    text = text.replace("redis-server - ", f"redis-server - --port {port} --bind 127.0.0.1 "
                                           f"--dir {data_dir} ")
    text = text.replace("redis-cli --tls", f"redis-cli -p {port} --tls")
    return text.replace("redis-cli ping", f"redis-cli -p {port} ping")


def tls_paths(container: TlsFiles, local: TlsFiles) -> dict[str, str]:
    """A deploy file's certificate paths (``container``) -> a test CA's (``local``)."""
    pairs = ((container.cert, local.cert), (container.key, local.key),
             (container.ca, local.ca))
    return {c: str(lp) for c, lp in pairs if c and lp}


def client(port: int, password: str | None, tls: TlsFiles | None = None) -> redis.Redis:
    """A client of the local server (with the test CA's files under TLS)."""
    files = tls or TlsFiles()
    return redis.Redis(port=port, password=password, socket_timeout=1,
                       retry=Retry(NoBackoff(), 0), ssl=tls is not None,
                       ssl_certfile=files.cert, ssl_keyfile=files.key,
                       ssl_ca_certs=files.ca)


@contextmanager
def running_redis(script: str, password_file: str, password: str, tmp_path: Path,
                  tls: tuple[TlsFiles, TlsFiles] | None = None
                  ) -> Iterator[tuple[int, Path]]:
    """The server ``script`` starts, with ``password`` in its password file: yields its
    port and the local password file (rewrite it to test a probe); stopped after. With
    ``tls`` (the script's certificate paths, a test CA's files) it serves TLS."""
    local_file = tmp_path / "redis-password"
    local_file.write_text(password + "\n")
    port = free_port()
    data_dir = tmp_path / "redis-data"
    data_dir.mkdir()
    paths = tls_paths(*tls) if tls else None
    proc = process.spawn(["/bin/sh", "-c", localize(script, password_file, local_file, port,
                                                    data_dir, paths)],
                         log_path=tmp_path / "redis.log")
    ping = client(port, password, tls[1] if tls else None)
    try:
        process.wait_ready(lambda: "" if ping.ping() else "no PONG", 10,
                           exited=lambda: None if proc.poll() is None else "exited",
                           interval_s=0.05)
        yield port, local_file
    finally:
        ping.close()
        process.stop([proc], grace_s=5)


def probe_passes(probe: str, password_file: str, local_file: Path, port: int,
                 tls: tuple[TlsFiles, TlsFiles] | None = None) -> bool:
    """Whether a ``/bin/sh -c`` probe of the server exits 0."""
    check = localize(probe, password_file, local_file, port, local_file.parent,
                     tls_paths(*tls) if tls else None)
    return subprocess.run(["/bin/sh", "-c", check], timeout=10).returncode == 0


def server_settings(port: int, password: str, tls: TlsFiles | None = None
                    ) -> dict[str, str]:
    """What the server says its cache settings are (and that it wants a password)."""
    with client(port, None, tls) as anonymous:
        try:
            anonymous.ping()
            auth = "none"
        except redis.AuthenticationError:
            auth = "required"
    settings = {"auth": auth}
    with client(port, password, tls) as c:
        for name in ("maxmemory", "maxmemory-policy", "save", "appendonly"):
            settings.update(c.config_get(name))
    return settings
