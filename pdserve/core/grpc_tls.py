"""Optional TLS on router→worker gRPC (``--tls-cert``, ``--tls-key``, ``--tls-ca``); the same
files as an ``ssl`` context for the sockets that are not gRPC (KV connections, etcd's health).

The cluster secret's proofs (``grpc_auth``) show both ends hold the secret; TLS keeps the
prompts from eavesdroppers and proves to the router that it talks to a worker
whose certificate the CA signed. One set of flags serves both ends:

- worker: serves TLS with ``--tls-cert``/``--tls-key``; with ``--tls-ca`` it also
  requires a client certificate signed by that CA (mutual TLS).
- router (and tools): verifies workers against ``--tls-ca`` (system roots
  without it) and presents ``--tls-cert``/``--tls-key`` as its client certificate
  when given. A worker's certificate must name the host the router dials (its
  advertised address), e.g. an IP SAN.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import grpc


@dataclass(frozen=True)
class TlsFiles:
    """Where the PEM files are; ``load`` reads them (once per process)."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    # ``--require-tls``: every cluster listener and client (gRPC, KV, etcd) uses mutual
    # TLS, and whatever cannot (a plaintext etcd URL, a ucx transport) refuses to start.
    required: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("--tls-cert and --tls-key go together")
        if self.required and not (self.cert and self.ca):
            raise ValueError("--require-tls needs --tls-cert, --tls-key and --tls-ca "
                             "(mutual TLS on every cluster connection)")

    @property
    def mutual(self) -> bool:
        """Both ends can prove themselves: what the KV channel and etcd need."""
        return bool(self.cert and self.ca)

    @property
    def enabled(self) -> bool:
        return bool(self.cert or self.ca)

    def flags(self) -> list[str]:
        """The same files as flags, for a child process."""
        files = [arg for name, path in (("--tls-cert", self.cert), ("--tls-key", self.key),
                                        ("--tls-ca", self.ca)) if path for arg in (name, path)]
        return [*files, "--require-tls"] if self.required else files

    def ssl_context(self, server: bool) -> ssl.SSLContext:
        """A mutual-TLS context of these files (the sockets' TLS: KV connections, etcd's
        health check): a server requires a client certificate the CA signed, a client
        verifies the server and its name; TLS 1.2 at least. ``ValueError`` names the
        files (never their content) when one does not load."""
        if not self.mutual:
            raise ValueError("mutual TLS needs --tls-cert, --tls-key and --tls-ca")
        assert self.cert and self.key and self.ca
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server
                                     else ssl.PROTOCOL_TLS_CLIENT)
            if server:
                context.verify_mode = ssl.CERT_REQUIRED
            context.minimum_version = ssl.TLSVersion.TLSv1_2
            context.load_cert_chain(self.cert, self.key)
            context.load_verify_locations(cafile=self.ca)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(f"cannot load the TLS files (--tls-cert {self.cert}, --tls-key, "
                             f"--tls-ca {self.ca}): {getattr(exc, 'strerror', None) or exc}"
                             ) from None
        return context

    def load(self) -> GrpcTls | None:
        """The credentials' bytes, or None without TLS; ``ValueError`` names an unreadable file."""
        return _load(self) if self.enabled else None


@dataclass(frozen=True)
class GrpcTls:
    cert: bytes | None = field(default=None, repr=False)
    key: bytes | None = field(default=None, repr=False)
    ca: bytes | None = field(default=None, repr=False)

    def server_credentials(self) -> grpc.ServerCredentials:
        if self.cert is None or self.key is None:
            raise ValueError("a TLS worker needs --tls-cert and --tls-key")
        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


@functools.lru_cache(maxsize=4)
def _load(files: TlsFiles) -> GrpcTls:
    return GrpcTls(_read(files.cert, "--tls-cert"), _read(files.key, "--tls-key"),
                   _read(files.ca, "--tls-ca"))


def _read(path: str | None, flag: str) -> bytes | None:
    if not path:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc.strerror or exc}") from None
