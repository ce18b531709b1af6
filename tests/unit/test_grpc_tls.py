"""gRPC TLS between the router and workers (``pdserve/core/grpc_tls.py``): a simulated
worker serving mutual TLS with the cluster token, a throwaway CA made here."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from unit.sim_cluster import start_sim_worker

from pdserve.cli.health import HealthTarget
from pdserve.cli.health import probe as health_probe
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls, TlsFiles
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient, probe_health
from pdserve.worker.sim.engine import SimConfig

SECRET = ClusterSecret(b"the-cluster-secret-0123456789")


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(name: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          issuer_key: ec.EllipticCurvePrivateKey, ca: bool = False) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(minutes=1))
               .not_valid_after(now + datetime.timedelta(hours=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA and one certificate it signed for 127.0.0.1 (worker and router share it)."""
    folder: Path = tmp_path_factory.mktemp("tls")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "pdserve test CA")])
    ca = _cert("pdserve test CA", ca_key, ca_name, ca_key, ca=True)
    cert = _cert("pdserve", key, ca_name, ca_key)
    pem = serialization.Encoding.PEM
    (folder / "ca.pem").write_bytes(ca.public_bytes(pem))
    (folder / "cert.pem").write_bytes(cert.public_bytes(pem))
    (folder / "key.pem").write_bytes(_pem_key(key))
    return TlsFiles(str(folder / "cert.pem"), str(folder / "key.pem"), str(folder / "ca.pem"))


async def test_mutual_tls_with_the_token(tls_files: TlsFiles) -> None:
    tls = tls_files.load()
    assert tls is not None and tls_files.load() is tls  # read once
    assert "PRIVATE KEY" not in repr(tls)  # the key stays out of logs
    server, port, _ = await start_sim_worker(SimConfig("prefill", "p0", block_size=16),
                                             secret=SECRET, tls=tls)
    endpoint = f"127.0.0.1:{port}"
    client = WorkerClient(endpoint, SECRET, tls=tls)
    try:
        assert (await client.health(timeout_s=5)).worker_id == "p0"
        assert (await asyncio.to_thread(probe_health, endpoint, 5, SECRET, tls)).ready
        no_client_cert = GrpcTls(ca=tls.ca)
        for other in (None, no_client_cert):  # plaintext, or TLS without a client certificate
            with pytest.raises(WorkerCallError, match="UNAVAILABLE"):
                await asyncio.to_thread(probe_health, endpoint, 3, SECRET, other)
        with pytest.raises(WorkerCallError, match="UNAUTHENTICATED"):  # TLS is not the token
            await asyncio.to_thread(probe_health, endpoint, 5, None, tls)
        # ``pdserve health`` (a container's probe): the standard service, over TLS.
        target = HealthTarget("grpc", "127.0.0.1", port)
        assert (await asyncio.to_thread(health_probe, target, 5, tls)).healthy
        assert not (await asyncio.to_thread(health_probe, target, 3)).healthy
    finally:
        await client.close()
        await server.stop(0)


def test_tls_flags_pair_up_and_pass_on(tls_files: TlsFiles) -> None:
    with pytest.raises(ValueError, match="go together"):
        TlsFiles(cert="c.pem")
    with pytest.raises(ValueError, match="cannot read --tls-ca"):
        TlsFiles(ca="/nonexistent/ca.pem").load()
    assert TlsFiles().load() is None
    flags = tls_files.flags()
    assert flags[::2] == ["--tls-cert", "--tls-key", "--tls-ca"]


def test_up_hands_every_child_its_tls_flags_as_parsed(tls_files: TlsFiles,
                                                      tmp_path: Path) -> None:
    """Each worker and the router parse up's TLS files and ``--require-tls`` back."""
    from pdserve.cli.configs import tls_files as parsed_tls
    from pdserve.cli.configs import up_config
    from pdserve.cli.parser import build_parser
    from pdserve.core.model import ResolvedModel
    from pdserve.launch.up import plan

    assert tls_files.cert and tls_files.key and tls_files.ca
    up = build_parser().parse_args(
        ["up", "--dtype", "float32", "--tls-cert", tls_files.cert, "--tls-key", tls_files.key,
         "--tls-ca", tls_files.ca, "--require-tls"])
    children = plan(up_config(up, ResolvedModel(Path("/models/tiny"), "tiny")), tmp_path)
    assert [c.name for c in children] == ["prefill-0", "decode-0", "router"]
    for child in children:
        command = child.argv[child.argv.index("pdserve.cli.main") + 1:]
        assert parsed_tls(build_parser().parse_args(command)) == parsed_tls(up), child.name
