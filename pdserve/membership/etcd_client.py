"""One etcd endpoint, and the aetcd client that talks to it (plaintext or TLS).

``--etcd http://HOST:PORT`` is plaintext; ``--etcd https://HOST:PORT`` is TLS, verified
against ``--tls-ca`` (the system roots without it), presenting ``--tls-cert``/``--tls-key``
as the client certificate when given (etcd's ``--client-cert-auth``). ``--require-tls``
refuses an ``http://`` URL before anything connects.

Why a subclass of ``aetcd.Client`` and not ``etcd3aio``: aetcd 1.0's ``connect()`` always
opens ``grpc.aio.insecure_channel``, but everything else it does (the stubs, the watcher,
the error mapping, the lease and transaction helpers) is independent of the channel's
credentials. ``TlsClient`` overrides ``connect()`` alone to open
``grpc.aio.secure_channel`` and builds the same stubs and watcher, so every call site,
``refresh_lease_once`` (which reaches into ``leasestub``) and every existing test run
unchanged over either channel. Moving to etcd3aio would rewrite every call site
(watch, transactions, leases, error types) and add a dependency for the same result.
What the subclass leans on (``_connected``, ``_is_connecting``, ``_options``, the stub
attributes) is pinned (aetcd 1.0.x) in pyproject.toml and exercised by the TLS tests.

With ``--etcd-user`` and ``--etcd-password-file`` (``EtcdAuth``), the client authenticates
with etcd's user/password auth (``Auth.Authenticate`` over the same gRPC channel; aetcd
sends the token etcd returns on every call). A token expires (etcd's
``--auth-token-ttl``, 300 s by default) or is invalidated by an etcd restart; a call then
fails UNAUTHENTICATED and ``renew_if_unauthenticated`` drops the connection, so the next
call connects and authenticates again.

Key material stays in the grpc credentials object, the password in the client: nothing
here logs, formats or repr()s it, and errors name the URL (``host:port``) only.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import aetcd
import grpc
from aetcd import rpc as aetcd_rpc
from aetcd import watcher as aetcd_watcher

from pdserve.core.cluster_secret import is_loopback
from pdserve.core.grpc_tls import TlsFiles

logger = logging.getLogger("pdserve.membership")

DEFAULT_CALL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class EtcdEndpoint:
    host: str
    port: int
    tls: bool  # https://

    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"


def parse_etcd_url(url: str) -> EtcdEndpoint:
    """``http://host:port``, ``https://host:port`` or ``host:port`` (plaintext), one
    endpoint; ``ValueError`` otherwise."""
    if not url:
        raise ValueError("etcd membership needs --etcd http(s)://HOST:PORT")
    parts = urlsplit(url if "://" in url else "http://" + url)
    if "@" in parts.netloc:  # checked first: the messages below quote the URL
        raise ValueError("--etcd takes no user or password in the URL; authenticate with a "
                         "client certificate (https:// and --tls-cert/--tls-key) or with "
                         "--etcd-user and --etcd-password-file")
    if "," in url:
        raise ValueError(f"--etcd takes one endpoint, not a list: {url!r}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--etcd must be http://HOST:PORT or https://HOST:PORT, not {url!r}")
    try:
        port = parts.port or 2379
    except ValueError:
        raise ValueError(f"bad port in --etcd {url!r}") from None
    return EtcdEndpoint(parts.hostname, port, parts.scheme == "https")


def check_etcd_url(url: str, tls: TlsFiles | None) -> EtcdEndpoint:
    """``parse_etcd_url``, and ``--require-tls`` refuses a plaintext etcd."""
    endpoint = parse_etcd_url(url)
    if tls is not None and tls.required and not endpoint.tls:
        raise ValueError(f"--require-tls refuses the plaintext etcd {url!r}: give "
                         "--etcd https://HOST:PORT (etcd with --client-cert-auth)")
    return endpoint


@dataclass(frozen=True)
class EtcdAuth:
    """etcd user/password authentication: ``--etcd-user`` and ``--etcd-password-file``
    (a file, so the password shows in no command line). Empty: none."""

    user: str = ""
    password_file: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        if bool(self.user) != bool(self.password_file):
            raise ValueError("--etcd-user and --etcd-password-file go together")

    def credentials(self) -> tuple[str | None, str | None]:
        """(user, password) for aetcd, (None, None) without auth; ``ValueError`` in one
        line for an unreadable or empty password file."""
        if not self.user:
            return None, None
        try:
            password = Path(self.password_file).read_text().strip()
        except OSError as exc:
            raise ValueError(f"cannot read --etcd-password-file {self.password_file}: "
                             f"{exc.strerror or exc}") from None
        if not password:
            raise ValueError(f"--etcd-password-file {self.password_file} is empty")
        return self.user, password


class TlsClient(aetcd.Client):
    """``aetcd.Client`` over a TLS channel (see the module docstring)."""

    _is_connecting: bool  # aetcd.Client's own flag (set in its __init__)

    def __init__(self, endpoint: EtcdEndpoint, credentials: grpc.ChannelCredentials,
                 timeout: float, auth: EtcdAuth | None = None) -> None:
        user, password = (auth or EtcdAuth()).credentials()
        super().__init__(endpoint.host, endpoint.port, username=user, password=password,
                         timeout=timeout)
        self._credentials = credentials
        self._user, self._secret = user, password

    async def connect(self) -> None:
        """As ``aetcd.Client.connect`` (user/password auth as there), with
        ``secure_channel``."""
        if self._connected.is_set():
            return
        if self._is_connecting:  # another task is connecting: wait for it
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}",
                                                   self._credentials,
                                                   options=list(self._options.items()))
            if self._user is not None:
                self.auth_stub = aetcd_rpc.AuthStub(self.channel)
                reply = await self.auth_stub.Authenticate(aetcd_rpc.AuthenticateRequest(
                    name=self._user, password=self._secret), timeout=self._timeout)
                self.metadata = (("token", reply.token),)
            self.kvstub = aetcd_rpc.KVStub(self.channel)
            self.clusterstub = aetcd_rpc.ClusterStub(self.channel)
            self.leasestub = aetcd_rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd_rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd_watcher.Watcher(aetcd_rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


def etcd_client(url: str, call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
                tls: TlsFiles | None = None, auth: EtcdAuth | None = None) -> aetcd.Client:
    """A client whose every call carries a ``call_timeout_s`` deadline; TLS for an
    ``https://`` URL with ``tls``'s files (``ValueError`` for an unreadable one, or for a
    plaintext URL under ``--require-tls``); etcd's user/password auth with ``auth``."""
    endpoint = check_etcd_url(url, tls)
    if not endpoint.tls:
        user, password = (auth or EtcdAuth()).credentials()
        if user is not None and not is_loopback(endpoint.host):
            logger.warning("etcd at %s is plaintext: the password of --etcd-user %s and its "
                           "tokens cross the network in the clear (use https:// with "
                           "--tls-ca)", url, user)
        return aetcd.Client(endpoint.host, endpoint.port, username=user, password=password,
                            timeout=call_timeout_s)
    loaded = (tls or TlsFiles()).load()
    credentials = (loaded.channel_credentials() if loaded is not None
                   else grpc.ssl_channel_credentials())  # no --tls-*: the system roots
    return TlsClient(endpoint, credentials, call_timeout_s, auth)
