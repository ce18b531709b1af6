"""Mutual TLS on KV connections (``kv_transfer/control/tls.py``): two tcp transports in this
process on 127.0.0.1 with certificates from a throwaway CA. A pull and a push move
the same bytes as in the clear, and nothing crosses the socket in the clear; a
plaintext client, a client without a certificate and one from another CA are each
refused before any KV byte leaves; ``--require-tls`` refuses the transports whose
bytes bypass the channel."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pdserve_testing import make_caches, start_transport

from pdserve.core.certs import make_test_ca
from pdserve.core.cluster_secret import ClusterSecret, num_refusals
from pdserve.core.grpc_tls import TlsFiles
from pdserve.kv_transfer.base import KVTransport, PeerAddress, TransportOptions
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.tls import KvTls, TlsHandshakeError, load_kv_tls
from pdserve.kv_transfer.control.wire import TransferError, recv_msg, send_msg
from pdserve.kv_transfer.leases import LeaseTable

SRC, DST = [1, 2, 3], [4, 5, 6]
SECRET = ClusterSecret(b"the-cluster-secret-0123456789")


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("kv-tls"))


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("kv-tls-other"))


@pytest.fixture
def sender(files: TlsFiles) -> Iterator[tuple[KVTransport, int, LeaseTable,
                                              dict[str, torch.Tensor]]]:
    """A TLS tcp sender holding a lease on ``SRC`` for request ``r``."""
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport("tcp", caches, leases,
                                      TransportOptions(tls=load_kv_tls(files)))
    yield transport, port, leases, caches
    transport.close()


def _pull(port: int, tls: KvTls | None, secret: ClusterSecret | None = None
          ) -> dict[str, torch.Tensor]:
    caches = make_caches(2, torch.float32)
    receiver, _ = start_transport("tcp", caches, LeaseTable(),
                                  TransportOptions(tls=tls, secret=secret))
    try:
        receiver.pull(PeerAddress("127.0.0.1", port), "r", SRC, DST, time.monotonic() + 20)
    finally:
        receiver.close()
    return caches


def test_a_pull_over_tls_moves_the_same_bytes(sender: tuple, files: TlsFiles) -> None:
    transport, port, leases, caches = sender
    got = _pull(port, load_kv_tls(files))
    assert all(torch.equal(caches[k][SRC], got[k][DST]) for k in caches)
    assert leases.take_done() == {"r"}
    assert transport.stats()["bytes_sent"] == sum(t[SRC].nbytes for t in caches.values())


def test_the_secret_challenge_runs_inside_tls(files: TlsFiles) -> None:
    leases = LeaseTable()
    leases.add("r", SRC, time.time() + 60)
    caches = make_caches(1, torch.float32)
    transport, port = start_transport(
        "tcp", caches, leases, TransportOptions(tls=load_kv_tls(files), secret=SECRET))
    try:
        got = _pull(port, load_kv_tls(files), SECRET)
        assert all(torch.equal(caches[k][SRC], got[k][DST]) for k in caches)
    finally:
        transport.close()


def _client_context(files: TlsFiles | None, ca: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=ca)
    if files is not None:
        context.load_cert_chain(str(files.cert), str(files.key))
    return context


@pytest.mark.parametrize("client", ["plaintext", "no_certificate", "other_ca"])
def test_a_client_without_a_certificate_the_ca_signed_gets_no_kv(
    sender: tuple, files: TlsFiles, other_ca: TlsFiles, client: str,
) -> None:
    transport, port, leases, _ = sender
    before = num_refusals("kv", "tls handshake failed")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        if client == "plaintext":  # a peer of a plaintext cluster: its hello is not TLS
            send_msg(raw, {"op": "hello", "compat": {}})
            raw.settimeout(5)
            assert _read_all(raw) == b""  # the server ends it, answering nothing
        else:
            own = None if client == "no_certificate" else other_ca
            conn = _client_context(own, str(files.ca)).wrap_socket(
                raw, server_hostname="127.0.0.1")
            with pytest.raises((ssl.SSLError, OSError)):  # refused in the handshake
                send_msg(conn, {"op": "status"})  # TLS 1.3: the refusal comes with a read
                conn.settimeout(5)
                if recv_msg(conn) is None:
                    raise ConnectionError("closed")
    assert _wait(lambda: num_refusals("kv", "tls handshake failed") == before + 1)
    assert transport.stats()["bytes_sent"] == 0
    assert leases.num_held == 1 and not leases.take_done()


def test_a_tls_client_refuses_a_server_with_another_cas_certificate(
    files: TlsFiles, other_ca: TlsFiles,
) -> None:
    leases = LeaseTable()
    transport, port = start_transport("tcp", make_caches(1, torch.float32), leases,
                                      TransportOptions(tls=load_kv_tls(other_ca)))
    try:
        with pytest.raises(TlsHandshakeError, match="TLS handshake failed: .*certificate"):
            request_once("127.0.0.1", port, {"op": "status"}, 5, tls=load_kv_tls(files))
        with pytest.raises(TlsHandshakeError):  # the pool says the same on a pull
            _pull(port, load_kv_tls(files))
    finally:
        transport.close()


def test_no_kv_byte_crosses_the_socket_in_the_clear(sender: tuple, files: TlsFiles) -> None:
    """A relay between the two ends sees only ciphertext: no 64-byte run of the
    sender's KV blocks appears in what it forwards."""
    transport, port, _, caches = sender
    relay, seen = _relay(port)
    try:
        got = _pull(relay, load_kv_tls(files))
    finally:
        time.sleep(0.1)
    assert all(torch.equal(caches[k][SRC], got[k][DST]) for k in caches)
    wire = bytes(seen)
    payload = b"".join(caches[k][SRC].numpy().tobytes() for k in caches)
    assert len(wire) > len(payload) > 0
    samples = [payload[i:i + 64] for i in range(0, len(payload) - 64, len(payload) // 16)]
    assert not any(s in wire for s in samples)


def test_status_over_tls_answers_and_plaintext_status_does_not(
    sender: tuple, files: TlsFiles,
) -> None:
    assert request_once("127.0.0.1", sender[1], {"op": "status"}, 5,
                        tls=load_kv_tls(files))["ok"]
    with pytest.raises(TransferError):
        request_once("127.0.0.1", sender[1], {"op": "status"}, 5)


def test_require_tls_refuses_a_transport_whose_bytes_bypass_it(files: TlsFiles) -> None:
    tls: dict[str, Any] = {"tls_cert": files.cert, "tls_key": files.key, "tls_ca": files.ca}
    with pytest.raises(ValueError, match="ucx transport moves KV bytes .* unencrypted"):
        ConnectorConfig(engine_id="w", transport="ucx", require_tls=True, **tls)
    with pytest.raises(ValueError, match="--require-tls needs"):
        ConnectorConfig(engine_id="w", require_tls=True)
    # gRPC-only TLS files (no client certificate, or no CA) keep KV plaintext, as before.
    assert ConnectorConfig(engine_id="w", tls_ca=files.ca).kv_tls() is None
    assert ConnectorConfig(engine_id="w", tls_cert=files.cert, tls_key=files.key).kv_tls() is None
    config = ConnectorConfig(engine_id="w", require_tls=True, **tls)
    assert config.transport_options().tls is not None
    assert "BEGIN" not in repr(config.transport_options())  # no key material in a repr


def test_unreadable_tls_files_are_a_clear_error_without_their_content(tmp_path: Path,
                                                                       files: TlsFiles) -> None:
    bad = tmp_path / "key.pem"
    bad.write_text("not a key")
    with pytest.raises(ValueError, match="cannot load the TLS files") as info:
        load_kv_tls(TlsFiles(files.cert, str(bad), files.ca))
    assert "not a key" not in str(info.value)


# ---- helpers -------------------------------------------------------------------------

def _read_all(conn: socket.socket) -> bytes:
    data = b""
    try:
        while chunk := conn.recv(4096):
            data += chunk
    except OSError:
        pass
    return data


def _wait(check: object, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def _relay(port: int) -> tuple[int, bytearray]:
    """A TCP relay to ``port`` that records every byte either way; returns its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    seen = bytearray()

    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                seen.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def accept() -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", port))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=pump, args=(a, b), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    return int(listener.getsockname()[1]), seen


def test_up_refuses_require_tls_with_a_transport_that_bypasses_it(files: TlsFiles) -> None:
    """At start, once, rather than in every worker it would restart."""
    from pdserve.launch.up import UpConfig

    required = TlsFiles(files.cert, files.key, files.ca, required=True)
    with pytest.raises(ValueError, match="torch transport moves KV bytes"):
        UpConfig(model="/m", transport="torch", tls=required)
    assert UpConfig(model="/m", transport="tcp", tls=required).tls.required
