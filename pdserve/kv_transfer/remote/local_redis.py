"""A local redis-server, or a Redis Cluster of several on one machine, for
``pdserve up`` and tests (Debian: ``apt-get install redis-server``; ``make etcd``
installs it).

Each server is a cache, never a database: no snapshots (``--save ''``), no append-only
file, a memory cap (``--maxmemory``) and an eviction policy the server applies when the
cap is reached (``allkeys-lru`` by default; ``volatile-ttl`` evicts the soonest to
expire), bound to 127.0.0.1 in a temporary directory that ``stop()`` removes. With a
``password_file`` (``pdserve up --with-redis`` makes one) the server requires that
password (``requirepass``), given in a config file in its own directory, never on its
command line.
With ``tls`` (mutual TLS files: ``pdserve up --with-redis`` hands it the cluster's) the
server listens for TLS only (``--port 0 --tls-port``), requires a client certificate its
CA signed (``--tls-auth-clients yes``) and its URL is ``rediss://``; a cluster's bus and
replication use TLS too.
``LocalRedisCluster`` starts ``masters`` cluster-enabled servers (each with ``replicas``
replicas) and joins them with ``redis-cli --cluster create``.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import redis

from pdserve.core import process
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.ports import free_port

START_TIMEOUT_S = 15.0
POLICIES = ("allkeys-lru", "allkeys-lfu", "volatile-ttl", "volatile-lru", "noeviction")


def redis_binary(name: str = "redis-server") -> str:
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"no `{name}` binary on PATH; install it (Debian/Ubuntu: "
                           "`sudo apt-get install redis-server`) or pass a store URL")
    return path


class LocalRedis:
    def __init__(self, maxmemory: str = "256mb", policy: str = "allkeys-lru",
                 port: int | None = None, cluster: bool = False,
                 data_dir: Path | None = None, log_path: Path | None = None,
                 password_file: Path | None = None, tls: TlsFiles | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown maxmemory policy {policy!r}; valid: "
                             f"{', '.join(POLICIES)}")
        self._binary = redis_binary()
        self.password = read_password(password_file) if password_file else None
        self.port = port or free_port()
        listen = _listen(self.port, tls)  # a bad TLS set fails before the folder is made
        self._own_dir = data_dir is None
        self.data_dir = data_dir or Path(tempfile.mkdtemp(prefix="pdserve-redis-"))
        self.tls = tls
        self._argv = [self._binary, *listen, "--bind", "127.0.0.1",
                      "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
                      "--maxmemory-policy", policy, "--dir", str(self.data_dir)]
        if cluster and tls is not None:
            self._argv += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        if cluster:
            self._argv += ["--cluster-enabled", "yes", "--cluster-config-file",
                           f"nodes-{self.port}.conf", "--cluster-node-timeout", "2000",
                           # a cache: the shards left keep serving when one is lost
                           "--cluster-require-full-coverage", "no"]
        self._log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"{'redis' if self.tls is None else 'rediss'}://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalRedis:
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # again after a stop
        argv = list(self._argv)
        if self.password is not None:  # redis-server takes a config file first
            argv.insert(1, str(self._write_conf(self.password)))
        self.proc = process.spawn(argv, log_path=self._log_path)
        try:
            process.wait_ready(self._ping, timeout_s, exited=self._exited, interval_s=0.05)
        except process.NotReadyError as exc:
            self.stop()
            raise process.NotReadyError(f"redis-server {exc}") from None
        return self

    def client(self, timeout_s: float = 1.0, check_hostname: bool = True) -> redis.Redis:
        """A plain client of this server (tests: raw keys, CONFIG, CLUSTER INFO); over
        TLS with the server's own files."""
        tls = self.tls or TlsFiles()
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=timeout_s,
                           socket_connect_timeout=timeout_s, password=self.password,
                           ssl=self.tls is not None, ssl_certfile=tls.cert,
                           ssl_keyfile=tls.key, ssl_ca_certs=tls.ca,
                           ssl_check_hostname=check_hostname)

    def _write_conf(self, password: str) -> Path:
        """``requirepass`` in a file only this user reads (in the server's directory)."""
        conf = self.data_dir / f"redis-{self.port}.conf"
        conf.touch(mode=0o600)
        conf.write_text(f"requirepass {_quoted(password)}\n")
        return conf

    def _ping(self) -> str:
        # the process this object started, on 127.0.0.1: whatever names its certificate
        # gives (a test's may give none that fits), its CA is still checked
        with self.client(timeout_s=0.5, check_hostname=False) as c:
            return "" if c.ping() else "no PONG"

    def _exited(self) -> str | None:
        rc = None if self.proc is None else self.proc.poll()
        return None if rc is None else f"exit code {rc}"

    def send_signal(self, sig: int) -> None:
        """``sig`` to the server (tests: SIGSTOP and SIGCONT)."""
        if self.proc is not None:
            process.signal_group(self.proc.pid, sig)

    def stop(self, sig: int = signal.SIGKILL, *, keep_dir: bool = False) -> None:
        """``sig`` (SIGKILL: nothing to save) to the server, SIGKILL after 5 s; its
        directory removed when this object made it, unless ``keep_dir``."""
        if self.proc is not None and self.proc.poll() is None:
            process.signal_group(self.proc.pid, signal.SIGCONT)  # a stopped one dies too
            process.stop([self.proc], grace_s=5, sig=sig)
        self.proc = None
        if self._own_dir and not keep_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def restart(self, timeout_s: float = START_TIMEOUT_S) -> LocalRedis:
        """A new server on the same port, settings and password (``up`` restarts a dead
        one); empty, as a cache after a crash is."""
        self.stop(keep_dir=True)
        return self.start(timeout_s)

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class LocalRedisCluster:
    def __init__(self, masters: int = 3, replicas: int = 0, maxmemory: str = "256mb",
                 policy: str = "allkeys-lru", log_path: Path | None = None,
                 tls: TlsFiles | None = None) -> None:
        if masters < 3:
            raise ValueError(f"a Redis Cluster needs >= 3 masters, not {masters}")
        if tls is not None and not tls.mutual:
            raise ValueError("a TLS redis-server needs a certificate, its key and a CA")
        self.data_dir = Path(tempfile.mkdtemp(prefix="pdserve-redis-cluster-"))
        self.nodes: list[LocalRedis] = []
        for _ in range(masters * (1 + replicas)):
            port = _cluster_port()
            node_dir = self.data_dir / str(port)
            node_dir.mkdir()
            self.nodes.append(LocalRedis(maxmemory, policy, port, cluster=True,
                                         data_dir=node_dir, log_path=log_path, tls=tls))
        self._replicas = replicas
        self.tls = tls

    @property
    def url(self) -> str:
        scheme = "redis-cluster" if self.tls is None else "rediss-cluster"
        return f"{scheme}://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def start(self, timeout_s: float = START_TIMEOUT_S) -> LocalRedisCluster:
        try:
            for node in self.nodes:
                node.start(timeout_s)
            argv = [redis_binary("redis-cli"), "--cluster", "create",
                    *(f"127.0.0.1:{n.port}" for n in self.nodes),
                    "--cluster-replicas", str(self._replicas), "--cluster-yes",
                    *_cli_tls(self.tls)]
            done = subprocess.run(argv, capture_output=True, timeout=timeout_s, check=False)
            if done.returncode != 0:
                raise process.NotReadyError(f"redis-cli --cluster create: exit "
                                            f"{done.returncode}: {done.stdout[-500:]!r}")
            process.wait_ready(self._cluster_ok, timeout_s, interval_s=0.1)
        except (process.NotReadyError, subprocess.TimeoutExpired):
            self.stop()
            raise
        return self

    def _cluster_ok(self) -> str:
        for node in self.nodes:
            with node.client(timeout_s=0.5) as c:
                info = c.cluster("info")
            if info.get("cluster_state") != "ok":
                return f"node {node.port}: cluster_state {info.get('cluster_state')}"
        return ""

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def read_password(path: Path) -> str:
    """A password file's first line (its line break dropped): what ``requirepass`` and
    ``--kv-store-password-file`` mean by the password."""
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"KV store password file {path}: {exc.strerror}") from None
    lines = text.splitlines()
    password = lines[0] if lines else ""
    if not password:
        raise ValueError(f"KV store password file {path} is empty")
    return password


def _listen(port: int, tls: TlsFiles | None) -> list[str]:
    """Plaintext on ``port``, or TLS only there with client certificates required."""
    if tls is None:
        return ["--port", str(port)]
    if not (tls.cert and tls.key and tls.ca):
        raise ValueError("a TLS redis-server needs a certificate, its key and a CA")
    return ["--port", "0", "--tls-port", str(port), "--tls-cert-file", tls.cert,
            "--tls-key-file", tls.key, "--tls-ca-cert-file", tls.ca,
            "--tls-auth-clients", "yes"]


def _cli_tls(tls: TlsFiles | None) -> list[str]:
    if tls is None or not (tls.cert and tls.key and tls.ca):
        return []
    return ["--tls", "--cert", tls.cert, "--key", tls.key, "--cacert", tls.ca]


def _quoted(text: str) -> str:
    """``text`` as a double-quoted redis.conf argument."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'


def _cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        port = free_port()
        if port + 10000 < 65536 and _is_free(port + 10000):
            return port
    raise RuntimeError("no free port pair (port, port + 10000) for a Redis Cluster node")


def _is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
