"""The cluster KV store over TLS, on a real redis-server serving TLS only with client
certificates required (``LocalRedis(tls=...)``, a throwaway CA from ``make_test_ca``):
blocks publish and load bit-exact over ``rediss://``; a client without a certificate,
one that trusts another CA and one dialling a name the certificate lacks are refused,
counted as store errors, and a worker's scheduler side then computes (the store is an
optimisation); ``--require-tls`` refuses a plaintext store URL before anything
connects (worker flags and ``up``). One TLS server serves the module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from unit.connector_fakes import FakeRequest
from unit.kv_store_helpers import IDENT, fresh_names, random_blocks

from pdserve.cli.configs import connector_config, up_store
from pdserve.cli.parser import build_parser
from pdserve.core.certs import make_test_ca
from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.remote.base import StoreError, StoreOptions, create_store
from pdserve.kv_transfer.remote.decision import FetchDecision
from pdserve.kv_transfer.remote.local_redis import LocalRedis, LocalRedisCluster
from pdserve.kv_transfer.remote.plan import StorePlanner
from pdserve.kv_transfer.remote.redis_store import RedisKVStore
from pdserve.launch import up
from pdserve.launch.up import UpConfig
from pdserve.launch.up_servers import KeptServer
from pdserve.launch.up_store import KvStoreUp

if TYPE_CHECKING:
    from vllm.v1.request import Request


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("store-tls"))


@pytest.fixture(scope="module")
def server(files: TlsFiles) -> Iterator[LocalRedis]:
    with LocalRedis(maxmemory="32mb", tls=files) as redis_server:
        yield redis_server


def _store(url: str, tls: TlsFiles) -> RedisKVStore:
    store = create_store(url, StoreOptions(timeout_s=1.0, tls=tls))
    assert isinstance(store, RedisKVStore)
    return store


def test_the_server_takes_tls_only_with_client_certificates(server: LocalRedis) -> None:
    assert server.url.startswith("rediss://127.0.0.1:")
    with server.client() as c:
        config = c.config_get("*")
    assert config["port"] == "0" and config["tls-port"] == str(server.port)
    assert config["tls-auth-clients"] == "yes"
    with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=1,
                     socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)
                     ) as plain, pytest.raises(redis.RedisError):
        plain.ping()  # a plaintext client gets no answer


def test_blocks_publish_and_load_bit_exact_over_rediss(server: LocalRedis,
                                                       files: TlsFiles) -> None:
    store = _store(server.url, files)
    try:
        names, blocks = fresh_names(3), random_blocks(3, 1 << 16)
        before = store.stats()
        assert store.put_blocks(list(zip(names, blocks, strict=True)), ttl_s=60) == 3
        assert store.lookup_prefix(names) == 3
        assert [bytes(b) if b is not None else None for b in store.get_blocks(names)] == blocks
        after = store.stats()
        assert after["put_written"] - before["put_written"] == 3
        assert after["get_hit_blocks"] - before["get_hit_blocks"] == 3
        assert after["errors"] == before["errors"]
    finally:
        store.close()


@pytest.mark.parametrize("client", ["no certificate", "another CA", "trusts another CA"])
def test_a_client_the_server_or_the_client_cannot_verify_is_refused_and_counted(
        server: LocalRedis, files: TlsFiles, tmp_path: Path, client: str) -> None:
    """No client certificate, or one of another CA: the server refuses. A good client
    certificate but another CA trusted: the client refuses the server's certificate
    (its own check, alone)."""
    other = make_test_ca(tmp_path / "other")
    tls = {"no certificate": TlsFiles(ca=files.ca), "another CA": other,
           "trusts another CA": TlsFiles(files.cert, files.key, other.ca)}[client]
    store = _store(server.url, tls)
    try:
        before = store.stats()
        with pytest.raises(StoreError, match="lookup failed"):
            store.lookup_prefix(fresh_names(2))
        after = store.stats()
        assert after["errors"] - before["errors"] == 1
        assert after["lookups"] == before["lookups"]
    finally:
        store.close()
    good = _store(server.url, files)  # the server still serves the cluster's clients
    try:
        assert good.lookup_prefix(fresh_names(1)) == 0
    finally:
        good.close()


def test_a_server_whose_certificate_does_not_name_the_host_is_refused(
        tmp_path: Path) -> None:
    elsewhere = make_test_ca(tmp_path / "elsewhere", hosts=("redis.example.internal",))
    with LocalRedis(maxmemory="16mb", tls=elsewhere) as other:
        store = _store(other.url, elsewhere)  # dials 127.0.0.1: not in the certificate
        try:
            with pytest.raises(StoreError, match="match|mismatch|IP address"):
                store.lookup_prefix(fresh_names(1))
        finally:
            store.close()



def test_a_refused_store_is_a_miss_the_worker_computes_and_counts(
        server: LocalRedis, files: TlsFiles) -> None:
    block_size = IDENT.block_size
    decision = FetchDecision(block_bytes=4096, block_size=block_size, per_token_s=1e-3)

    def planner(tls: TlsFiles) -> StorePlanner:
        return StorePlanner(lambda: create_store(server.url, StoreOptions(1.0, tls=tls)),
                            IDENT, block_size, decision, ttl_s=60)

    tokens = [7000 + i for i in range(3 * block_size + 1)]
    refused, trusted = planner(TlsFiles(ca=files.ca)), planner(files)
    try:
        r1 = cast("Request", FakeRequest("r1", tokens))
        t1 = cast("Request", FakeRequest("t1", tokens))
        assert refused.match(r1, 0) == 0  # computed, not failed
        assert trusted.match(t1, 0) == 0  # a miss: nothing published
        refused_counts, trusted_counts = refused.take_counts(), trusted.take_counts()
    finally:
        refused.close()
        trusted.close()
    assert refused_counts.get("store_lookup_errors") == 1
    assert not refused_counts.get("store_lookups")
    assert trusted_counts.get("store_lookups") == 1
    assert not trusted_counts.get("store_lookup_errors")


def _worker_connector(argv: list[str]) -> ConnectorConfig:
    args = build_parser().parse_args(["prefill", "--model", "/m", *argv])
    return connector_config(args, "prefill-0", "127.0.0.1")


@pytest.mark.parametrize("url", ["redis://r:6379", "redis-cluster://a:7000,b:7000"])
def test_require_tls_refuses_a_plaintext_store_url(files: TlsFiles, url: str) -> None:
    tls = ["--tls-cert", str(files.cert), "--tls-key", str(files.key),
           "--tls-ca", str(files.ca)]
    tls_url = url.replace("redis", "rediss", 1)
    assert _worker_connector([*tls, "--kv-store", url]).kv_store == url  # allowed without
    assert _worker_connector([*tls, "--require-tls", "--kv-store", tls_url]
                             ).kv_store == tls_url
    with pytest.raises(ValueError, match="--require-tls refuses the plaintext KV store"):
        _worker_connector([*tls, "--require-tls", "--kv-store", url])
    required = TlsFiles(files.cert, files.key, files.ca, required=True)
    UpConfig(model="/m", tls=required, kv_store=KvStoreUp(url=tls_url))
    with pytest.raises(ValueError, match="--require-tls refuses the plaintext KV store"):
        UpConfig(model="/m", tls=required, kv_store=KvStoreUp(url=url))


def test_the_store_tls_flags_override_the_cluster_files(files: TlsFiles,
                                                        tmp_path: Path) -> None:
    other = make_test_ca(tmp_path / "store-ca")
    cluster = ["--tls-cert", str(files.cert), "--tls-key", str(files.key),
               "--tls-ca", str(files.ca), "--kv-store", "rediss://r:6380"]
    assert _worker_connector(cluster).store_options().tls == TlsFiles(
        files.cert, files.key, files.ca)
    own = _worker_connector([*cluster, "--kv-store-tls-ca", str(other.ca),
                             "--kv-store-tls-cert", str(other.cert),
                             "--kv-store-tls-key", str(other.key)])
    assert own.store_options().tls == TlsFiles(other.cert, other.key, other.ca)
    with pytest.raises(ValueError, match="go together"):
        _worker_connector([*cluster, "--kv-store-tls-cert", str(other.cert)])
    with pytest.raises(ValueError, match="cannot read"):
        _worker_connector([*cluster, "--kv-store-tls-ca", str(tmp_path / "missing.pem")])


def test_a_tls_redis_cluster_serves_rediss_cluster_urls(files: TlsFiles) -> None:
    with LocalRedisCluster(masters=3, maxmemory="16mb", tls=files) as cluster:
        assert cluster.url.startswith("rediss-cluster://127.0.0.1:")
        store = _store(cluster.url, files)
        try:
            prompts = [fresh_names(2) for _ in range(4)]  # several slots, several shards
            blocks = [random_blocks(2, 4096) for _ in prompts]
            items = [(n, b) for names, bs in zip(prompts, blocks, strict=True)
                     for n, b in zip(names, bs, strict=True)]
            assert store.put_blocks(items, ttl_s=60) == 8
            got = store.get_blocks([n for names in prompts for n in names])
            assert [bytes(b) if b is not None else None for b in got] == [
                b for bs in blocks for b in bs]
        finally:
            store.close()
        # a cluster client asks for the slot table at once: without a certificate, no node
        # answers it
        with pytest.raises(StoreError, match="no cluster node answered"):
            _store(cluster.url, TlsFiles(ca=files.ca))


def test_up_with_redis_under_require_tls_hands_workers_a_tls_only_store(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: TlsFiles) -> None:
    """run_up as `up --with-redis --require-tls` runs it, the children replaced by a
    stand-in that opens the store as a worker parses its flags."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    seen: dict[str, object] = {}

    def children(cfg: UpConfig, log_dir: Path, servers: list[KeptServer]) -> int:
        argv = next(c.argv for c in up.plan(cfg, log_dir) if c.name == "prefill-0")
        connector = connector_config(build_parser().parse_args(argv[argv.index("prefill"):]),
                                     "prefill-0", "127.0.0.1")
        store = create_store(str(connector.kv_store), connector.store_options())
        try:
            names, blocks = fresh_names(2), random_blocks(2)
            seen.update(url=connector.kv_store, written=store.put_blocks(
                list(zip(names, blocks, strict=True)), ttl_s=60))
        finally:
            store.close()
        port = int(str(connector.kv_store).rsplit(":", 1)[1])
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=1,
                         socket_connect_timeout=1, retry=Retry(NoBackoff(), 0)) as plain:
            with pytest.raises(redis.RedisError):
                plain.ping()
        return 0

    monkeypatch.setattr(up, "_run_children", children)
    required = TlsFiles(files.cert, files.key, files.ca, required=True)
    assert up.run_up(UpConfig(model="/m", tls=required, kv_store=KvStoreUp(
        with_redis=True, redis_maxmemory="32mb"))) == 0
    assert str(seen["url"]).startswith("rediss://127.0.0.1:") and seen["written"] == 2


def test_up_hands_the_store_tls_flags_to_every_worker(files: TlsFiles, tmp_path: Path) -> None:
    other = make_test_ca(tmp_path / "store-ca")
    args = build_parser().parse_args([
        "up", "--model", "/m", "--kv-store", "rediss://r:6380", "--kv-store-tls-ca",
        str(other.ca), "--kv-store-tls-cert", str(other.cert), "--kv-store-tls-key",
        str(other.key)])
    store = up_store(args)
    assert (store.tls_ca, store.tls_cert, store.tls_key) == (other.ca, other.cert, other.key)
    for child in up.plan(UpConfig(model="/m", num_prefill=1, kv_store=store), tmp_path):
        if child.name == "router":
            assert "--kv-store-tls-ca" not in child.argv
            continue
        role = child.name.split("-")[0]
        connector = _worker_connector(child.argv[child.argv.index(role) + 1:])
        assert connector.store_tls() == TlsFiles(other.cert, other.key, other.ca)
    with pytest.raises(ValueError, match="need a --kv-store URL"):
        KvStoreUp(with_redis=True, tls_ca=other.ca)
