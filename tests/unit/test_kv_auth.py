"""Cluster authentication on KV connections (``kv_transfer/control/auth.py``), per transport,
two transports in this process on 127.0.0.1: the right secret transfers, a wrong
or missing one is refused before any KV byte leaves, and no secret on both sides
works as before."""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from pdserve_testing import NUM_BLOCKS, compat, make_caches, start_transport

from pdserve.core.cluster_secret import (
    ClusterSecret,
    load_cluster_secret,
    note_refusal,
    num_refusals,
    write_cluster_secret,
)
from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions, create_transport
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.auth import AuthError, authenticate_to_server
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError, recv_msg, send_msg
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.push.inbox import PushInbox

RIGHT = ClusterSecret(b"the-cluster-secret-0123456789")
WRONG = ClusterSecret(b"another-cluster-secret-98765")
SRC, DST = [1, 2, 3], [4, 5, 6]


def _options(secret: ClusterSecret | None) -> TransportOptions:
    return TransportOptions(secret=secret)


@pytest.fixture
def sender() -> Iterator[tuple[KVTransport, int, LeaseTable, dict[str, torch.Tensor]]]:
    """A tcp sender holding a lease on ``SRC`` for request ``r``, with ``RIGHT``."""
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport("tcp", caches, leases, _options(RIGHT))
    yield transport, port, leases, caches
    transport.close()


def _pull(name: str, port: int, secret: ClusterSecret | None
          ) -> tuple[dict[str, torch.Tensor], KVTransport]:
    caches = make_caches(2, torch.float32)
    receiver, _ = start_transport(name, caches, LeaseTable(), _options(secret))
    try:
        receiver.pull(PeerAddress("127.0.0.1", port), "r", SRC, DST, time.monotonic() + 20)
    finally:
        receiver.close()
    return caches, receiver


def _moved(src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(src[k][SRC], dst[k][DST]) for k in src)


def _untouched(dst: dict[str, torch.Tensor]) -> bool:
    fresh = make_caches(2, torch.float32)
    return all(torch.equal(fresh[k], dst[k]) for k in dst)


def test_right_secret_transfers(sender: tuple) -> None:
    transport, port, leases, caches = sender
    got, _ = _pull("tcp", port, RIGHT)
    assert _moved(caches, got)
    assert leases.take_done() == {"r"}
    assert transport.stats()["bytes_sent"] == sum(t[SRC].nbytes for t in caches.values())


@pytest.mark.parametrize("secret", [WRONG, None], ids=["wrong_secret", "no_secret"])
def test_peer_without_the_secret_gets_no_kv(sender: tuple, secret: ClusterSecret | None
                                            ) -> None:
    transport, port, leases, _ = sender
    reason = "wrong secret" if secret is not None else "no credentials"
    before = num_refusals("kv", reason)
    with pytest.raises(TransferError, match="authentication"):
        got, _ = _pull("tcp", port, secret)
    assert num_refusals("kv", reason) == before + 1
    assert transport.stats()["bytes_sent"] == 0
    assert leases.num_held == 1 and not leases.take_done()  # the lease is still the decode's


def test_wrong_secret_reads_nothing_after_the_handshake(sender: tuple) -> None:
    """A raw client: after a failed proof the connection only ends, whatever it asks."""
    transport, port, _, _ = sender
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        with pytest.raises(AuthError, match="authentication failed"):
            authenticate_to_server(conn, WRONG, time.monotonic() + 5, "sender")
        with pytest.raises(OSError):  # the server closed: the pull cannot even be sent whole
            deadline = time.monotonic() + 10.0  # for the close to land on a loaded machine
            while time.monotonic() < deadline:
                send_msg(conn, {"op": "pull", "req": "r", "runs": [[1, 3]]})
                time.sleep(0.01)
        assert _read_all(conn) == b""
    assert transport.stats()["bytes_sent"] == 0


def test_unauthenticated_ops_get_one_refusal_and_no_kv(sender: tuple) -> None:
    """hello, status and pull straight away, as a peer of an unauthenticated cluster
    would: one refusal message comes back (no KV, no counters) and the socket ends."""
    transport, port, leases, _ = sender
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        for msg in ({"op": "status"}, {"op": "hello", "compat": {}},
                    {"op": "pull", "req": "r", "runs": [[1, 3]]}):
            try:
                send_msg(conn, msg)
            except OSError:
                break
        reply = recv_msg(conn)
        assert reply is not None and reply["ok"] is False and "secret" in reply["error"]
        assert _read_all(conn) == b""
    assert transport.stats()["bytes_sent"] == 0 and leases.num_held == 1
    with pytest.raises(TransferError, match="authentication"):
        request_once("127.0.0.1", port, {"op": "status"}, 5)
    assert request_once("127.0.0.1", port, {"op": "status"}, 5, RIGHT)["num_leases"] == 1


def test_secret_client_refuses_an_open_server() -> None:
    """A server without the secret cannot prove it: the client stops, saying why."""
    transport, port = start_transport("tcp", make_caches(1, torch.float32), LeaseTable())
    try:
        with pytest.raises(AuthError, match="no cluster secret"):
            request_once("127.0.0.1", port, {"op": "status"}, 5, RIGHT)
        with pytest.raises(AuthError, match="no cluster secret"):
            _pull("tcp", port, RIGHT)
    finally:
        transport.close()


def test_no_secret_on_both_sides_still_works() -> None:
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport("tcp", caches, leases)
    try:
        got, _ = _pull("tcp", port, None)
        assert _moved(caches, got)
    finally:
        transport.close()


@pytest.mark.parametrize("name", ["ucx", "torch"])
def test_other_transports_authenticate_on_their_control_channel(name: str) -> None:
    """ucx and torch (gloo) negotiate their data path on the same control channel:
    with the right secret KV moves; with a wrong one the negotiation never starts."""
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport(name, caches, leases, _options(RIGHT))
    try:
        with pytest.raises(AuthError):
            _pull(name, port, WRONG)
        assert transport.stats()["bytes_sent"] == 0 and leases.num_held == 1
        got, _ = _pull(name, port, RIGHT)
        assert _moved(caches, got)
    finally:
        transport.close()


@pytest.mark.parametrize("secret", [WRONG, None], ids=["wrong_secret", "no_secret"])
def test_push_from_a_peer_without_the_secret_is_refused(secret: ClusterSecret | None) -> None:
    """Layer-wise push rides the same authenticated connections: nothing lands in
    the decode's inbox from a prefill without the secret; the right one pushes."""
    caches = {k: torch.zeros_like(v) for k, v in make_caches(0, torch.float32).items()}
    layout = KVLayout.from_kv_caches(caches, NUM_BLOCKS, 16)
    inbox = PushInbox(layout, 64 << 20, ttl_s=30)
    decode = create_transport("tcp", _options(RIGHT))
    channel = decode.push_channel()
    assert channel is not None
    channel.accept_pushes(inbox)
    port = decode.start(kv_caches=list(caches.values()), layout=layout, leases=LeaseTable(),
                        compat=dict(compat(torch.float32), layout=layout.describe()),
                        host="127.0.0.1", port=0)
    prefills = [start_transport("tcp", make_caches(1, torch.float32), LeaseTable(),
                                _options(s))[0] for s in (secret, RIGHT)]
    try:
        bad, good = (p.push_channel() for p in prefills)
        assert bad is not None and good is not None
        peer = PeerAddress("127.0.0.1", port)
        with pytest.raises(TransferError, match="authentication"):
            bad.push(peer, "t1", 0, 0, SRC, len(SRC), True, time.monotonic() + 5)
        assert inbox.num_bytes == 0 and decode.stats()["bytes_received"] == 0
        layer = make_caches(1, torch.float32)["layer.0"]
        sent = good.push(peer, "t2", 0, 0, SRC, len(SRC), True, time.monotonic() + 5)
        assert sent == layer[SRC].nbytes
        assert inbox.num_bytes == sent * inbox.num_layers  # one entry, every layer staged
    finally:
        for transport in (decode, *prefills):
            transport.close()


def test_refusals_are_counted_but_logged_at_most_once_a_while(
        caplog: pytest.LogCaptureFixture) -> None:
    before = num_refusals("kv", "test flood")
    with caplog.at_level(logging.WARNING, logger="pdserve.auth"):
        for _ in range(20):
            note_refusal("kv", "test flood", "10.0.0.1:1234")
    assert num_refusals("kv", "test flood") == before + 20
    assert len([r for r in caplog.records if "test flood" in r.getMessage()]) == 1


def test_secret_file_is_read_once_and_checked(tmp_path: Path) -> None:
    path = write_cluster_secret(tmp_path / "secret")
    assert path.stat().st_mode & 0o777 == 0o600
    secret = load_cluster_secret(str(path))
    assert load_cluster_secret(str(path)) is secret  # once per process
    assert str(path) in repr(secret) and path.read_text().strip() not in repr(secret)
    (tmp_path / "short").write_text("tooshort\n")
    with pytest.raises(ValueError, match="at least 16"):
        load_cluster_secret(str(tmp_path / "short"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="holds 0 bytes"):
        load_cluster_secret(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="cannot read"):
        load_cluster_secret(str(tmp_path / "missing"))


def _read_all(conn: socket.socket) -> bytes:
    data = b""
    conn.settimeout(5)
    try:
        while chunk := conn.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


def test_connector_config_carries_the_path_not_the_secret(tmp_path: Path) -> None:
    """The connector's settings reach vLLM's engine processes through its (logged) config:
    only the file's path travels; each process reads the secret itself."""
    path = write_cluster_secret(tmp_path / "secret")
    config = ConnectorConfig(engine_id="e", cluster_secret_file=str(path))
    extra = config.to_extra_config()
    assert path.read_text().strip() not in repr(extra)
    options = ConnectorConfig.from_extra_config(extra).transport_options()
    assert options.secret is load_cluster_secret(str(path))
    assert path.read_text().strip() not in repr(options)
    assert ConnectorConfig(engine_id="e").transport_options().secret is None
