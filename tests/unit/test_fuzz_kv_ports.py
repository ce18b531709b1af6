"""Bad input on the KV port (issue 30, part 4): the fuzzer (``pdserve.bench.fuzz``)
against live tcp transports on fake KV, open and with a cluster secret; the inputs
that killed a server thread before, one by one; and the fuzzer's own detectors shown
to fire (a crash, a leaked lease). The large run is ``pdserve bench fuzz``'s."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest

from pdserve.bench.fuzz.kv_client import frames, read_until_eof
from pdserve.bench.fuzz.kv_driver import PortReport, fuzz_port
from pdserve.bench.fuzz.kv_mutate import frame, frame_raw
from pdserve.bench.fuzz.kv_remote import learn_compat
from pdserve.bench.fuzz.kv_target import InProcessTarget
from pdserve.bench.fuzz.report import render
from pdserve.cli import bench
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.kv_transfer.control.dial import request_once

SECRET = ClusterSecret(b"fuzz-test-secret-0123456789abcdef")
IDLE_S = 1.0


@pytest.fixture
def target() -> Iterator[InProcessTarget]:
    t = InProcessTarget("kv", None, IDLE_S)
    yield t
    t.close()


def _assert_clean(report: PortReport) -> None:
    assert report.passed, render([report])
    assert report.crashes == []
    assert report.total("hung") == report.total("refused") == 0
    assert (report.leaks.leases, report.leaks.blocks) == (0, 0)
    base, after = report.leaks.threads or (None, None)
    assert after == base, "a fuzzed connection kept its server thread"
    assert report.liveness == "pull+push ok"
    # The handshake gates every KV op: none is served before it, each is answered.
    gated = report.outcomes["before_hello"]
    assert gated["error"] == sum(gated.values()) > 0


def test_fuzzing_the_open_kv_port_crashes_nothing_and_leaks_nothing(
        target: InProcessTarget) -> None:
    report = fuzz_port(target, 1000, seed=11)
    _assert_clean(report)
    assert set(report.outcomes) >= {"random", "truncated", "malformed", "before_hello",
                                    "unknown_pull", "push_range", "slow", "stall"}
    assert report.stall_max_s is not None and report.stall_max_s < IDLE_S + 1.5
    malformed = report.outcomes["malformed"]
    assert malformed["error"] > 0.8 * sum(malformed.values())  # answered, not just dropped


def test_fuzzing_the_kv_port_with_a_secret_authenticates_no_garbage() -> None:
    target = InProcessTarget("kv+secret", SECRET, IDLE_S)
    try:
        report = fuzz_port(target, 600, seed=12)
    finally:
        target.close()
    _assert_clean(report)
    auth = report.outcomes["auth"]
    assert sum(auth.values()) > 50 and auth["ok"] == 0  # garbage never gets past the challenge


def _exchange(target: InProcessTarget, data: bytes, hello: bool = True) -> list[dict]:
    """``data`` on a fresh connection (after a hello), half-closed: every reply, once the
    server closed it."""
    with socket.create_connection((target.peer.host, target.peer.port), timeout=10) as sock:
        prefix = frame({"op": "hello", "compat": target.peer.compat}) if hello else b""
        sock.sendall(prefix + data)
        sock.shutdown(socket.SHUT_WR)  # the server answers a refusal before its EOF
        received, eof = read_until_eof(sock, time.monotonic() + 10)
    assert eof
    return frames(received)[1 if hello else 0:]


# Each of these killed the connection's server thread before (KeyError, TypeError,
# OverflowError, RecursionError, a memoryview error): now an error names the field.
@pytest.mark.parametrize(("body", "hello", "named"), [
    (b'{"op":["x"]}', False, "'op' must be a string"),
    (b'{"op":"hello","compat":[1]}', False, "'compat' must be an object"),
    (b'{"op":"release"}', False, "'req' is missing"),
    (b"[" * 5000, False, "not JSON"),
    (b'{"op":"pull"}', True, "'req' is missing"),
    (b'{"op":"pull","req":"r9","runs":5}', True, "'runs' must be a list"),
    (b'{"op":"push"}', True, "'nbytes' is missing"),
    (b'{"op":"push","nbytes":1,"xfer":"x","layer":1e400,"first":0,"count":1,"num_blocks":1}',
     True, "'layer' must be an integer"),
    (b'{"op":"push","nbytes":0,"xfer":"x","layer":0,"first":0,"count":0,"num_blocks":1}',
     True, "'count' must be an integer in [1, 1]"),
    (b'{"op":"push_abort"}', True, "'xfer' is missing"),
])
def test_a_bad_message_is_answered_and_closes_only_its_connection(
        target: InProcessTarget, body: bytes, hello: bool, named: str) -> None:
    replies = _exchange(target, frame_raw(body) + frame({"op": "status"}), hello)
    assert len(replies) == 1, replies  # answered, then closed: the status after is not read
    assert replies[0]["ok"] is False and named in replies[0]["error"]
    assert target.crashes() == []
    assert request_once(target.peer.host, target.peer.port, {"op": "status"}, 5)["ok"]


def test_a_pull_with_a_negative_count_reads_no_block_and_keeps_the_lease(
        target: InProcessTarget) -> None:
    """[first, -n] named no block, so passed the lease check, yet sliced
    outer[first:first-n]: most of the KV cache, other requests' blocks included."""
    target.leases.add("victim", [2], time.time() + 60)
    replies = _exchange(target, frame({"op": "pull", "req": "victim", "runs": [[2, -5]]}))
    assert replies[0]["ok"] is False and "'runs'" in replies[0]["error"]
    assert len(replies) == 1  # no KV bytes, no trailer
    assert target.leases.checkout("victim", 0.1) == (2,)  # a bad pull ends no lease


def test_a_push_of_the_wrong_size_stages_nothing(target: InProcessTarget) -> None:
    want = target.inbox.payload_bytes(0, 1)
    header = {"op": "push", "xfer": "t", "layer": 0, "first": 0, "count": 1,
              "num_blocks": 1, "nbytes": want + 1}
    replies = _exchange(target, frame(header) + bytes(want + 1))
    assert replies[0]["ok"] is False and f"{want} here" in replies[0]["error"]
    assert target.inbox.num_bytes == 0


def test_the_fuzzer_sees_a_handler_crash_and_a_stuck_lease(
        target: InProcessTarget, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its detectors can fail: a handler raising TypeError is a crash, and a pull whose
    lease never ends is a leaked lease."""
    def broken(conn: socket.socket, msg: dict, inbox: object) -> None:
        raise TypeError("injected")

    monkeypatch.setattr("pdserve.kv_transfer.transports.tcp.serve_push_abort", broken)
    report = fuzz_port(target, 99, seed=13)  # under 100: no slow input (5 s)
    assert not report.passed
    assert any("TypeError: injected" in c for c in report.crashes), report.crashes
    monkeypatch.setattr(target.leases, "finish", lambda req, why="": False)
    assert target.liveness() == "pull+push ok"  # the pull works, its lease stays
    assert target.settle([], 2.0).leases == 1


def test_the_cli_prints_the_table_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["fuzz", "--inputs", "60", "--idle-timeout-s", "1"]) == 0
    out = capsys.readouterr().out
    assert "kv+secret" in out and "pull+push ok" in out
    assert bench.main(["fuzz", "--target", "nohost"]) == 2
    assert "--target must be HOST:PORT" in capsys.readouterr().err


@pytest.mark.parametrize("secret", [None, SECRET])
def test_a_remote_port_tells_the_compat_its_hello_takes(secret: ClusterSecret | None) -> None:
    """``--target`` learns the hello a worker accepts from its refusal of an empty one."""
    target = InProcessTarget("kv", secret, IDLE_S)
    try:
        assert learn_compat(target.peer.host, target.peer.port, secret) == target.peer.compat
    finally:
        target.close()
