"""``pdserve up`` with the cluster KV store: the ``--kv-store*`` and ``--kv-compression``
flags reach every vLLM worker as the worker parses them, ``--with-redis`` starts a local
redis-server with a password and a memory cap (and removes it again), and every mistake
is refused before any child starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from pdserve.cli.configs import connector_config, up_config
from pdserve.cli.parser import build_parser
from pdserve.core.model import ResolvedModel
from pdserve.launch.up import UpConfig, plan
from pdserve.launch.up_servers import KeptServer
from pdserve.launch.up_store import LOCAL_POLICY, KvStoreUp, LocalStore

MODEL = ResolvedModel(Path("/models/tiny"), "tiny")


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "kv-password"
    path.write_text("s3cret-pass\n")
    return path


def _workers(cfg: UpConfig, log_dir: Path) -> dict[str, list[str]]:
    return {c.name: c.argv for c in plan(cfg, log_dir) if c.name != "router"}


def test_up_hands_the_store_to_every_worker_as_the_worker_reads_it(
        tmp_path: Path, password_file: Path) -> None:
    before = _workers(UpConfig(model="/m", num_prefill=2), tmp_path)
    assert not any("--kv-store" in argv or "--kv-compression" in argv
                   for argv in before.values())
    store = KvStoreUp(url="redis-cluster://r1:7000,r2:7001", ttl_s=60.0, timeout_s=0.25,
                      password_file=str(password_file), compression="lossless")
    children = {c.name: c.argv for c in plan(UpConfig(model="/m", num_prefill=2,
                                                      kv_store=store), tmp_path)}
    workers = {n: a for n, a in children.items() if n != "router"}
    assert set(workers) == {"prefill-0", "prefill-1", "decode-0"}
    for name, argv in workers.items():
        role = name.split("-")[0]
        args = build_parser().parse_args(argv[argv.index(role):])
        connector = connector_config(args, name, "127.0.0.1")
        assert (connector.kv_store, connector.kv_store_ttl_s, connector.kv_store_timeout_s,
                connector.kv_store_password_file, connector.kv_compression) == (
            "redis-cluster://r1:7000,r2:7001", 60.0, 0.25, str(password_file), "lossless")
        assert "s3cret-pass" not in " ".join(argv)  # the file's name, never the password
    assert "--kv-store" not in children["router"]


def test_compression_alone_is_passed_on_without_a_store(tmp_path: Path) -> None:
    cfg = UpConfig(model="/m", kv_store=KvStoreUp(compression="int8"))
    for argv in _workers(cfg, tmp_path).values():
        assert argv[argv.index("--kv-compression") + 1] == "int8"
        assert "--kv-store" not in argv


def test_up_config_from_the_store_flags(password_file: Path) -> None:
    args = build_parser().parse_args([
        "up", "--kv-store", "redis://store:6379/2", "--kv-store-ttl-s", "120",
        "--kv-store-timeout-s", "0.2", "--kv-store-password-file", str(password_file),
        "--kv-compression", "fp8", "--dtype", "float32"])
    assert up_config(args, MODEL).kv_store == KvStoreUp(
        url="redis://store:6379/2", ttl_s=120.0, timeout_s=0.2,
        password_file=str(password_file), compression="fp8")
    local = up_config(build_parser().parse_args(
        ["up", "--with-redis", "--redis-maxmemory", "2GB", "--dtype", "float32"]), MODEL)
    assert local.kv_store == KvStoreUp(with_redis=True, redis_maxmemory="2gb")
    assert up_config(build_parser().parse_args(["up", "--dtype", "float32"]),
                     MODEL).kv_store == KvStoreUp()


MISTAKES = {
    "url and with-redis": (dict(url="redis://r:6379", with_redis=True), "not both"),
    "a password in the url": (dict(url="redis://:pw@r:6379"), "no password in the URL"),
    "an unknown scheme": (dict(url="memcached://r:11211"), "valid schemes: redis://"),
    # the client takes a query's options over ours: TLS checks off, a password past the
    # check above
    "tls checks off in a query": (dict(url="rediss://r:6379/0?ssl_cert_reqs=none"),
                                  "no query or fragment"),
    "a password in a query": (dict(url="redis://r:6379/0?password=pw"), "no query"),
    "a password file without a store": (dict(password_file="/etc/hostname"),
                                        "needs --kv-store URL or --with-redis"),
    "a missing password file": (dict(url="redis://r:6379", password_file="/nonexistent/pw"),
                                "No such file"),
    "no memory cap": (dict(with_redis=True, redis_maxmemory="0"), "memory size"),
    "a bad compression": (dict(compression="zstd"), "--kv-compression"),
}


@pytest.mark.parametrize(("fields", "why"), MISTAKES.values(), ids=MISTAKES.keys())
def test_store_mistakes_are_refused(fields: dict[str, object], why: str) -> None:
    with pytest.raises(ValueError, match=why):
        KvStoreUp(**fields)  # type: ignore[arg-type]


def test_an_empty_password_file_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        KvStoreUp(with_redis=True, password_file=str(empty))


def test_simulated_workers_take_no_store() -> None:
    with pytest.raises(ValueError, match="simulated workers have no KV cache"):
        UpConfig(model="/m", simulated=True, kv_store=KvStoreUp(with_redis=True))


def test_the_cli_refuses_with_redis_beside_a_url_and_a_bad_maxmemory(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--redis-maxmemory", "lots"])
    assert "memory size" in capsys.readouterr().err
    args = build_parser().parse_args(["up", "--with-redis", "--kv-store", "redis://r:1",
                                      "--dtype", "float32"])
    with pytest.raises(ValueError, match="not both"):
        up_config(args, MODEL)


def test_with_redis_starts_a_capped_server_with_a_password_and_removes_it(
        tmp_path: Path) -> None:
    log_dir = tmp_path / "logs"
    local = LocalStore(KvStoreUp(with_redis=True, redis_maxmemory="64mb",
                                 compression="lossless"), log_dir).start()
    try:
        store = local.store
        assert store.url == local.server.url and not store.with_redis
        assert store.compression == "lossless"
        password_file = Path(str(store.password_file))
        assert password_file.stat().st_mode & 0o077 == 0
        with local.server.client() as c:  # up's own password
            assert c.config_get("maxmemory") == {"maxmemory": str(64 << 20)}
            assert c.config_get("maxmemory-policy") == {"maxmemory-policy": LOCAL_POLICY}
        anonymous = redis.Redis(port=local.server.port, socket_timeout=1)
        with anonymous, pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        assert (log_dir / "redis.log").stat().st_size > 0
        argv = _workers(UpConfig(model="/m", kv_store=store), tmp_path)["decode-0"]
        assert argv[argv.index("--kv-store") + 1] == local.server.url
        assert argv[argv.index("--kv-store-password-file") + 1] == str(password_file)
        data_dir = local.server.data_dir
    finally:
        local.stop()
    assert local.server.proc is None
    assert not password_file.exists() and not data_dir.exists()


def test_with_redis_uses_a_given_password_file_and_keeps_it(
        tmp_path: Path, password_file: Path) -> None:
    local = LocalStore(KvStoreUp(with_redis=True, password_file=str(password_file)),
                       tmp_path).start()
    try:
        assert local.store.password_file == str(password_file)
        with redis.Redis(port=local.server.port, password="s3cret-pass",
                         socket_timeout=1) as c:
            assert c.ping()
        conf = next(local.server.data_dir.glob("redis-*.conf"))
        assert conf.stat().st_mode & 0o077 == 0
    finally:
        local.stop()
    assert password_file.read_text() == "s3cret-pass\n"


@pytest.mark.parametrize("outcome", ["serves", "fails"])
def test_run_up_with_redis_hands_the_children_a_live_store_and_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str) -> None:
    """run_up as `up --with-redis` runs it, the children replaced by a stand-in that
    reaches the store the workers would be told about."""
    from pdserve.kv_transfer.remote.local_redis import read_password
    from pdserve.launch import up

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    seen: dict[str, object] = {}

    def children(cfg: UpConfig, log_dir: Path, servers: list[KeptServer]) -> int:
        assert [s.name for s in servers] == ["redis"]  # kept alive by up's watch
        store = cfg.kv_store
        assert store.url and store.password_file and not store.with_redis
        password = read_password(Path(store.password_file))
        with redis.Redis.from_url(store.url, password=password, socket_timeout=1) as c:
            seen.update(ping=c.ping(), url=store.url, log_dir=log_dir,
                        password_file=Path(store.password_file))
        if outcome == "fails":
            raise OSError("a child could not start")
        return 0

    monkeypatch.setattr(up, "_run_children", children)
    cfg = UpConfig(model="/m", kv_store=KvStoreUp(with_redis=True, redis_maxmemory="32mb"))
    if outcome == "fails":
        with pytest.raises(OSError):
            up.run_up(cfg)
    else:
        assert up.run_up(cfg) == 0
    assert seen["ping"] is True
    assert (Path(str(seen["log_dir"])) / "redis.log").exists()
    assert not Path(str(seen["password_file"])).exists()  # up's own, removed
    with redis.Redis.from_url(str(seen["url"]), socket_timeout=1,
                              socket_connect_timeout=1) as gone, pytest.raises(
            redis.ConnectionError):
        gone.ping()
