"""etcd with user/password auth (``--etcd-user``, ``--etcd-password-file``) against a
real etcd (``LocalEtcd``) with auth enabled: a root user, and a ``pdserve`` user whose
role may read and write ``/pdserve/`` only. Registration and the router's list + watch
work with the password; without it, or with a wrong one, nothing is registered or
listed and the log says why."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest
from aetcd import rpc
from prometheus_client import CollectorRegistry
from unit.fake_worker import eventually

from pdserve.launch.up import UpConfig, plan
from pdserve.membership import MembershipConfig, WorkerInfo, worker_key
from pdserve.membership.etcd import EtcdMembership, close_client
from pdserve.membership.etcd_client import EtcdAuth, etcd_client
from pdserve.membership.etcd_registrar import EtcdRegistrar
from pdserve.membership.local_etcd import LocalEtcd

USER, PASSWORD = "pdserve", "pdserve-password-1"
SETTLE_S = 10.0


async def _enable_auth(target: str) -> None:
    """root (role root) and pdserve (readwrite on /pdserve/...), then auth on."""
    async with grpc.aio.insecure_channel(target) as channel:
        auth = rpc.AuthStub(channel)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name="root"), timeout=5)
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-pw-123"),
                           timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"),
                                 timeout=5)
        await auth.RoleAdd(rpc.AuthRoleAddRequest(name=USER), timeout=5)
        await auth.RoleGrantPermission(rpc.AuthRoleGrantPermissionRequest(
            name=USER, perm=rpc.Permission(permType=rpc.Permission.READWRITE,
                                           key=b"/pdserve/", range_end=b"/pdserve0")),
            timeout=5)
        await auth.UserAdd(rpc.AuthUserAddRequest(name=USER, password=PASSWORD), timeout=5)
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=USER, role=USER), timeout=5)
        await auth.AuthEnable(rpc.AuthEnableRequest(), timeout=5)


@pytest.fixture(scope="module")
def etcd() -> Iterator[LocalEtcd]:
    with LocalEtcd() as server:
        asyncio.run(_enable_auth(server.url.removeprefix("http://")))
        yield server


@pytest.fixture
def password_file(tmp_path: Path) -> Path:
    path = tmp_path / "etcd-password"
    path.write_text(PASSWORD + "\n")
    path.chmod(0o600)
    return path


class Sink:
    """The router's pool as membership sees it: member ids."""

    def __init__(self) -> None:
        self.members: set[str] = set()

    async def replace_all(self, infos: Sequence[WorkerInfo]) -> None:
        self.members = {i.member_id for i in infos}

    async def put(self, info: WorkerInfo) -> None:
        self.members.add(info.member_id)

    async def delete(self, member_id: str) -> None:
        self.members.discard(member_id)


def _info(worker_id: str) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, role="decode", grpc_endpoint="127.0.0.1:1")


async def test_registration_and_watch_work_with_the_password(etcd: LocalEtcd,
                                                             password_file: Path) -> None:
    auth = EtcdAuth(USER, str(password_file))
    membership = EtcdMembership(etcd.url, "auth-ok", registry=CollectorRegistry(),
                                probe_interval_s=0.2, retry_s=0.2, auth=auth)
    sink = Sink()
    watching = asyncio.create_task(membership.run(sink))
    registrar = EtcdRegistrar(etcd.url, "auth-ok", ttl_s=10, auth=auth)
    try:
        await eventually(lambda: membership.connected, SETTLE_S, "listed with the password")
        await registrar.start(_info("d-1"))
        assert registrar.num_registrations == 1
        await eventually(lambda: sink.members == {"decode/d-1"}, SETTLE_S, "watched put")
        await registrar.close()
        await eventually(lambda: sink.members == set(), SETTLE_S, "watched delete")
    finally:
        await registrar.close()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


@pytest.mark.parametrize("wrong", [False, True], ids=["no-password", "wrong-password"])
async def test_without_the_password_nothing_registers_and_the_log_says_why(
        etcd: LocalEtcd, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        wrong: bool) -> None:
    auth = None
    if wrong:
        (tmp_path / "wrong").write_text("not-the-password\n")
        auth = EtcdAuth(USER, str(tmp_path / "wrong"))
    caplog.set_level(logging.WARNING, "pdserve.membership")
    registrar = EtcdRegistrar(etcd.url, "auth-refused", ttl_s=10, auth=auth)
    membership = EtcdMembership(etcd.url, "auth-refused", registry=CollectorRegistry(),
                                retry_s=0.2, auth=auth)
    watching = asyncio.create_task(membership.run(Sink()))
    try:
        await registrar.start(_info("d-2"))  # returns; never raises for etcd
        await eventually(lambda: caplog.text.count("refused our credentials") >= 2,
                         SETTLE_S, "the registrar's and the router's refusals logged")
        assert registrar.num_registrations == 0 and not membership.connected
        why = "user name is empty" if auth is None else "authentication failed"
        assert why in caplog.text, caplog.text
    finally:
        await registrar.close()
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)


def test_flags_go_together(password_file: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        EtcdAuth(USER, "")
    with pytest.raises(ValueError, match="needs --etcd"):
        MembershipConfig.from_flags(None, "c", 10, auth=EtcdAuth(USER, str(password_file)))
    with pytest.raises(ValueError, match="cannot read"):
        EtcdAuth(USER, str(password_file) + ".missing").credentials()
    assert PASSWORD not in repr(EtcdAuth(USER, str(password_file)))


@pytest.fixture(scope="module")
def short_tokens() -> Iterator[LocalEtcd]:
    """An etcd with auth whose tokens lapse after 1 s unused (``--auth-token-ttl``)."""
    with LocalEtcd(extra_args=("--auth-token-ttl", "1")) as server:
        asyncio.run(_enable_auth(server.url.removeprefix("http://")))
        yield server


async def test_an_expired_token_is_renewed(short_tokens: LocalEtcd,
                                           password_file: Path) -> None:
    """The registrar's token lapses between its keepalives (lease keepalives need none);
    its lease is then revoked, so it must write its entry again: that put fails
    UNAUTHENTICATED on the old token, the registrar reconnects, authenticates again and
    registers (without the renewal it would retry the dead token for ever)."""
    auth = EtcdAuth(USER, str(password_file))
    registrar = EtcdRegistrar(short_tokens.url, "auth-renew", ttl_s=6, auth=auth)
    other = etcd_client(short_tokens.url, auth=auth)
    key = worker_key("auth-renew", "decode", "d-3").encode()
    try:
        await registrar.start(_info("d-3"))
        assert registrar.num_registrations == 1 and registrar.lease_id is not None
        await asyncio.sleep(1.5)  # the registrar's token lapses
        await other.revoke_lease(registrar.lease_id)  # (a fresh client: a fresh token)
        await eventually(lambda: registrar.num_registrations == 2, SETTLE_S,
                         "registered again with a renewed token")
        await close_client(other)  # its own token lapsed meanwhile: a fresh one
        assert await other.get(key) is not None
    finally:
        await registrar.close()
        await close_client(other)


def test_up_hands_the_password_file_never_the_password(password_file: Path,
                                                       tmp_path: Path) -> None:
    auth = EtcdAuth(USER, str(password_file))
    children = plan(UpConfig(model="/m", etcd="http://10.0.0.5:2379", etcd_auth=auth), tmp_path)
    for child in children:
        i = child.argv.index("--etcd-user")
        assert child.argv[i + 1] == USER
        assert child.argv[child.argv.index("--etcd-password-file") + 1] == str(password_file)
        assert PASSWORD not in " ".join(child.argv)
    with pytest.raises(ValueError, match="--etcd-user needs --etcd"):
        UpConfig(model="/m", with_etcd=True, etcd_auth=auth)
