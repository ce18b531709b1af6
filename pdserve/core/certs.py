"""A throwaway certificate authority for a test or compose cluster (``pdserve certs``).

One CA and one certificate it signed, valid for every name and address given, for
both ends of every connection (server and client authentication): the same three
files serve ``--tls-cert``, ``--tls-key`` and ``--tls-ca`` on the router, the
workers (gRPC and KV) and etcd. Production clusters get theirs from their own CA
(the chart's cert-manager ``Certificate``); this is for tests, laptops and compose.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pdserve.core.grpc_tls import TlsFiles

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
DEFAULT_DAYS = 30


def make_test_ca(folder: Path, hosts: Sequence[str] = DEFAULT_HOSTS,
                 days: int = DEFAULT_DAYS) -> TlsFiles:
    """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` (the key mode 0600) into ``folder``; the
    CA's own key is never written (nothing more can be signed: make a new CA)."""
    if not hosts:
        raise ValueError("a certificate needs at least one host name or address")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = _name(f"pdserve test CA {os.urandom(4).hex()}")  # two CAs never share a name
    now = datetime.datetime.now(datetime.UTC)
    ca = (_builder(ca_name, ca_name, ca_key, now, days)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                       False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    cert = (_builder(_name("pdserve"), ca_name, key, now, days)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    files = TlsFiles(str(folder / "cert.pem"), str(folder / "key.pem"), str(folder / "ca.pem"))
    _write(folder / "ca.pem", ca.public_bytes(pem), 0o644)
    _write(folder / "cert.pem", cert.public_bytes(pem), 0o644)
    _write(folder / "key.pem", key.private_bytes(pem, serialization.PrivateFormat.PKCS8,
                                                 serialization.NoEncryption()), 0o600)
    return files


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey,
             now: datetime.datetime, days: int) -> x509.CertificateBuilder:
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days)))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _write(path: Path, data: bytes, mode: int) -> None:
    path.unlink(missing_ok=True)  # a new file gets ``mode``; an old one keeps its own
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)
