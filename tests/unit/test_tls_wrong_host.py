"""A certificate for another host is refused on every cluster connection (issue 40):
``pdserve certs`` material (``make_test_ca``) naming ``localhost`` only, served on
127.0.0.1 and dialled as ``127.0.0.1``. The same CA signed it, so only the host name is
wrong: the router refuses the worker (gRPC), a KV client the KV server, and the etcd
client the etcd. Dialled as ``localhost`` each works, so each refusal is the name's."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import aetcd
import pytest
import torch
from cryptography import x509
from pdserve_testing import make_caches, start_transport
from unit.sim_cluster import start_sim_worker

from pdserve.core.bounded import bounded
from pdserve.core.certs import make_test_ca
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.base import TransportOptions
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.tls import TlsHandshakeError, load_kv_tls
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.membership.etcd import close_client, etcd_client
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient, probe_health
from pdserve.worker.sim.engine import SimConfig

SECRET = ClusterSecret(b"the-cluster-secret-0123456789")
REFUSED_S = 5.0  # a refused handshake fails at once; this only bounds a hang


@pytest.fixture(scope="module")
def other_host(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    """A CA and a certificate it signed for ``localhost`` only (not 127.0.0.1)."""
    return make_test_ca(tmp_path_factory.mktemp("wrong-host"), hosts=("localhost",))


async def test_the_router_refuses_a_worker_whose_certificate_names_another_host(
        other_host: TlsFiles) -> None:
    tls = other_host.load()
    server, port, _ = await start_sim_worker(SimConfig("decode", "d0", block_size=16),
                                             secret=SECRET, tls=tls)
    try:
        wrong = WorkerClient(f"127.0.0.1:{port}", SECRET, tls=tls)
        right = WorkerClient(f"localhost:{port}", SECRET, tls=tls)
        try:
            with pytest.raises(WorkerCallError) as refused:
                await wrong.health(timeout_s=REFUSED_S)
            assert refused.value.code == "UNAVAILABLE"
            assert (await right.health(timeout_s=REFUSED_S)).worker_id == "d0"
        finally:
            await wrong.close()
            await right.close()
        with pytest.raises(WorkerCallError, match="UNAVAILABLE"):
            probe_health(f"127.0.0.1:{port}", REFUSED_S, SECRET, tls)
    finally:
        await server.stop(0)


def test_a_kv_client_refuses_a_server_whose_certificate_names_another_host(
        other_host: TlsFiles) -> None:
    tls = load_kv_tls(other_host)
    transport, port = start_transport("tcp", make_caches(1, torch.float32), LeaseTable(),
                                      TransportOptions(tls=tls, secret=SECRET))
    try:
        with pytest.raises(TlsHandshakeError, match="TLS handshake failed"):
            request_once("127.0.0.1", port, {"op": "status"}, REFUSED_S, tls=tls,
                         secret=SECRET)
        reply = request_once("localhost", port, {"op": "status"}, REFUSED_S, tls=tls,
                             secret=SECRET)
        assert reply is not None and reply.get("ok")
        assert transport.stats()["bytes_sent"] == 0
    finally:
        transport.close()


@pytest.fixture(scope="module")
def etcd(other_host: TlsFiles) -> Iterator[LocalEtcd]:
    server = LocalEtcd(tls=other_host)
    # etcd's own readiness probe dials 127.0.0.1 too; only the clients under test check
    # the name.
    assert server._health_tls is not None
    server._health_tls.check_hostname = False
    with server:
        yield server


async def test_the_etcd_client_refuses_an_etcd_whose_certificate_names_another_host(
        etcd: LocalEtcd, other_host: TlsFiles) -> None:
    start = time.monotonic()
    wrong = etcd_client(etcd.url, tls=other_host)  # https://127.0.0.1:PORT
    try:
        with pytest.raises(aetcd.ClientError):
            await bounded(wrong.get(b"/pdserve/probe"), REFUSED_S + 1)
    finally:
        await close_client(wrong)
    assert time.monotonic() - start < REFUSED_S + 1
    right = etcd_client(etcd.url.replace("127.0.0.1", "localhost"), tls=other_host)
    try:
        assert await bounded(right.get(b"/pdserve/probe"), REFUSED_S) is None
    finally:
        await close_client(right)


def test_certs_writes_only_the_names_given(other_host: TlsFiles) -> None:
    cert = x509.load_pem_x509_certificate(Path(str(other_host.cert)).read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["localhost"]
    assert names.get_values_for_type(x509.IPAddress) == []
