"""etcd over mutual TLS against a real etcd (``LocalEtcd(tls=...)``, a throwaway CA from
``make_test_ca``): a worker's registration, the router's list + watch, a lease keepalive
and the planner election all work over TLS; a plaintext client, a client without a
certificate and a client of another CA are refused; ``--require-tls`` refuses an http://
etcd URL before anything connects. One TLS etcd serves the whole module."""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aetcd
import httpx
import pytest
from unit.fake_worker import eventually, start_fake_worker

from pdserve.cli.configs import router_config, worker_config, worker_membership
from pdserve.cli.parser import build_parser
from pdserve.core.bounded import bounded
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles
from pdserve.core.model import ResolvedModel
from pdserve.launch.up import UpConfig, plan
from pdserve.membership import (
    MembershipConfig,
    WorkerInfo,
    create_election,
    create_membership,
    create_registrar,
)
from pdserve.membership.etcd import EtcdMembership, close_client, etcd_client
from pdserve.membership.etcd_registrar import EtcdRegistrar
from pdserve.membership.local_etcd import LocalEtcd
from pdserve.router.dispatch.workers.pool import WorkerPool

TTL_S = 2
SETTLE_S = 10.0  # generous: a bound on a watch event reaching the pool on a loaded machine
REFUSED_S = 5.0  # a refused handshake fails at once; this only bounds a hang


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("etcd-tls"))


@pytest.fixture(scope="module")
def etcd(files: TlsFiles) -> Iterator[LocalEtcd]:
    with LocalEtcd(tls=files) as server:
        yield server


async def refused(client: aetcd.Client) -> str:
    """The error a ``get`` through ``client`` fails with (the test fails if it succeeds)."""
    try:
        with pytest.raises(aetcd.ClientError) as caught:
            await bounded(client.get(b"/pdserve/probe"), REFUSED_S)
    finally:
        await close_client(client)
    return str(caught.value)


def test_local_etcd_serves_only_tls_with_client_certificates(etcd: LocalEtcd,
                                                             files: TlsFiles) -> None:
    assert etcd.url.startswith("https://127.0.0.1:")
    with pytest.raises(httpx.HTTPError):  # plaintext HTTP to the TLS port
        httpx.get(etcd.url.replace("https://", "http://") + "/health", timeout=REFUSED_S)
    with pytest.raises(httpx.HTTPError):  # TLS, but no client certificate
        httpx.get(etcd.url + "/health", verify=ssl.create_default_context(cafile=files.ca),
                  timeout=REFUSED_S)
    with pytest.raises(ValueError, match="--tls-ca"):  # client certificates need a CA
        LocalEtcd(tls=TlsFiles(files.cert, files.key))


async def test_registration_watch_lease_and_election_over_tls(etcd: LocalEtcd,
                                                              files: TlsFiles) -> None:
    """What ``pdserve prefill``/``router --etcd https://... --tls-*`` build: the router's
    pool learns the worker through the watch, the lease is kept alive, a revoke removes
    it, and the planner election runs on the same TLS etcd."""
    config = MembershipConfig.from_flags(etcd.url, "tls", TTL_S,
                                         tls=TlsFiles(files.cert, files.key, files.ca,
                                                      required=True))
    worker = await start_fake_worker("decode")
    info = WorkerInfo(worker_id=f"fake-decode-{id(worker.servicer):x}", role="decode",
                      grpc_endpoint=worker.endpoint, compatibility_hash="compat-a",
                      model="fake", block_size=128)  # the id the fake's Health reports
    pool = WorkerPool(interval_s=0.5)
    membership = create_membership(config)
    registrar = create_registrar(config)
    election = create_election(config, True, "router-tls")
    assert isinstance(membership, EtcdMembership) and isinstance(registrar, EtcdRegistrar)
    await pool.start(membership)
    try:
        await eventually(lambda: membership.connected, SETTLE_S, "the router lists over TLS")
        assert membership.describe()["tls"] is True
        await registrar.start(info)  # after the listing: reaches the pool through the watch
        await eventually(lambda: any(w.snapshot().worker_id == info.worker_id and
                                     w.snapshot().healthy for w in pool.all),
                         SETTLE_S, "the worker is routable")
        first_lease = registrar.lease_id
        assert first_lease is not None and await registrar._refresh()  # a keepalive over TLS
        assert registrar.lease_id == first_lease and registrar.num_registrations == 1
        await election.start()
        await eventually(lambda: election.is_leader, SETTLE_S, "the only candidate leads")
        await registrar.close()  # the lease is revoked: the watch removes the worker
        await eventually(lambda: not pool.all, SETTLE_S, "removed after the revoke")
    finally:
        await election.close()
        await registrar.close()
        await pool.close()
        await worker.stop()


async def test_a_plaintext_client_is_refused(etcd: LocalEtcd) -> None:
    await refused(etcd_client(etcd.url.replace("https://", "http://")))


async def test_a_client_without_a_certificate_or_of_another_ca_is_refused(
        etcd: LocalEtcd, files: TlsFiles, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    await refused(etcd_client(etcd.url, tls=TlsFiles(ca=files.ca)))  # no client certificate
    other = make_test_ca(tmp_path / "other")
    # Its certificate is not the etcd CA's, and etcd's is not its CA's: refused both ways.
    await refused(etcd_client(etcd.url, tls=other))
    await refused(etcd_client(etcd.url, tls=TlsFiles(other.cert, other.key, files.ca)))
    # The router's outage log names etcd's URL, never key material.
    membership = EtcdMembership(etcd.url, "tls-refused", tls=TlsFiles(ca=files.ca),
                                retry_s=0.1)
    with caplog.at_level(logging.WARNING, logger="pdserve.membership.etcd"):
        async with _running(membership):
            await eventually(lambda: "unreachable" in caplog.text, SETTLE_S, "outage logged")
    assert not membership.connected
    key_body = Path(str(files.key)).read_text().splitlines()[1]
    assert key_body not in caplog.text and key_body not in str(membership.describe())


def test_require_tls_refuses_a_plaintext_etcd_url(files: TlsFiles, tmp_path: Path) -> None:
    required = TlsFiles(files.cert, files.key, files.ca, required=True)
    for make in (lambda: MembershipConfig.from_flags("http://127.0.0.1:2379", "c", 10,
                                                     tls=required),
                 lambda: MembershipConfig.from_flags("127.0.0.1:2379", "c", 10, tls=required),
                 lambda: EtcdRegistrar("http://127.0.0.1:2379", tls=required),
                 lambda: UpConfig(model="/m", etcd="http://127.0.0.1:2379", tls=required)):
        with pytest.raises(ValueError, match="--require-tls refuses the plaintext etcd"):
            make()
    assert MembershipConfig.from_flags("https://10.0.0.5:2379", "c", 10, tls=required).tls \
        == required
    up = UpConfig(model="/m", etcd="https://10.0.0.5:2379", tls=required)
    for argv in (child.argv for child in plan(up, tmp_path)):  # every child: https + files
        assert argv[argv.index("--etcd") + 1] == "https://10.0.0.5:2379"
        assert "--require-tls" in argv and argv[argv.index("--tls-ca") + 1] == files.ca
    # Without --require-tls the same TLS files leave an http:// etcd plaintext.
    MembershipConfig.from_flags("http://127.0.0.1:2379", "c", 10, tls=files)
    with pytest.raises(ValueError, match="client certificate") as caught:
        MembershipConfig.from_flags("etcd://root:s3cret@10.0.0.5:2379", "c", 10)
    assert "s3cret" not in str(caught.value)


def test_the_command_line_hands_the_tls_files_to_etcd(files: TlsFiles,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """``router``, ``decode`` and ``sim-worker`` build their etcd clients with ``--tls-*``;
    ``--require-tls`` with an http:// ``--etcd`` is an error before anything starts."""
    for name in [n for n in os.environ if n.startswith("PDSERVE_") and n != "PDSERVE_CACHE"]:
        monkeypatch.delenv(name)
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key), "--tls-ca", str(files.ca),
           "--require-tls"]
    model = ResolvedModel(Path("/models/tiny"), "tiny")
    required = TlsFiles(files.cert, files.key, files.ca, required=True)
    parse = build_parser().parse_args
    router = router_config(parse(["router", "--etcd", "https://e:2379", *tls]), model)
    decode = worker_config(parse(["decode", "--etcd", "https://e:2379", *tls]), model)
    sim = worker_membership(parse(["sim-worker", "--etcd", "https://e:2379", *tls]))
    assert router.membership.tls == decode.membership.tls == sim.tls == required
    with pytest.raises(ValueError, match="--require-tls refuses the plaintext etcd"):
        router_config(parse(["router", "--etcd", "http://e:2379", *tls]), model)


@contextlib.asynccontextmanager
async def _running(membership: EtcdMembership) -> AsyncIterator[None]:
    """``membership`` feeding a pool, closed on exit."""
    pool = WorkerPool()
    await pool.start(membership)
    try:
        yield
    finally:
        await pool.close()
