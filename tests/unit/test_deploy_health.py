"""``pdserve health``, the image's HEALTHCHECK: one probe of a router's HTTP ``/health``
or a worker's standard gRPC health service, with a deadline; exit 0 healthy, 1 not."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from pdserve.cli.health import HealthTarget, probe
from pdserve.cli.main import main
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.launch.sim_worker import sim_host
from pdserve.worker.servicer import start_worker_server
from pdserve.worker.sim.engine import SimConfig


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.release = threading.Event()  # set when the test ends: /slow answers then


class _Handler(http.server.BaseHTTPRequestHandler):
    """200 on /health, 503 on /sick, on /slow an answer only once the test has ended."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/slow":
            assert isinstance(self.server, _Server)
            self.server.release.wait(60.0)
        self.send_response({"/health": 200, "/sick": 503}.get(self.path, 404))
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_port() -> Iterator[int]:
    server = _Server()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.release.set()
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_targets_parse_and_a_bad_one_names_the_forms() -> None:
    assert HealthTarget.parse("http://router:8001/health") == HealthTarget(
        "http", "router", 8001, "/health")
    assert HealthTarget.parse("grpc://127.0.0.1:50051") == HealthTarget(
        "grpc", "127.0.0.1", 50051, "/")
    for bad in ("ftp://x:1", "http://nohost", "grpc://w:1/path", "router:8000", "grpc://w:x"):
        with pytest.raises(ValueError, match="expected"):
            HealthTarget.parse(bad)


def test_http_health_is_200_only(http_port: int, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["health", "--healthcheck", f"http://127.0.0.1:{http_port}/health"]) == 0
    assert main(["health", "--healthcheck", f"http://127.0.0.1:{http_port}/sick"]) == 1
    assert "503" in capsys.readouterr().err
    started = time.monotonic()
    late = probe(HealthTarget("http", "127.0.0.1", http_port, "/slow"), timeout_s=0.2)
    assert not late.healthy and "Timeout" in late.detail
    # The 0.2 s deadline ended it, not the server, which holds /slow until the test
    # ends (60 s at most).
    assert time.monotonic() - started < 20.0
    refused = probe(HealthTarget("http", "127.0.0.1", _closed_port(), "/health"), 1.0)
    assert not refused.healthy


def test_the_target_comes_from_the_environment(
        http_port: int, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PDSERVE_HEALTHCHECK", f"http://127.0.0.1:{http_port}/health")
    assert main(["health"]) == 0
    monkeypatch.setenv("PDSERVE_HEALTHCHECK", "router:8000")
    with pytest.raises(SystemExit) as exit_info:
        main(["health"])
    assert exit_info.value.code == 2
    assert "PDSERVE_HEALTHCHECK" in capsys.readouterr().err


async def test_grpc_health_of_a_worker_follows_its_serving_state() -> None:
    """A (simulated) worker's standard health service: SERVING once ready, NOT_SERVING
    while draining, unreachable once stopped; the probe asks without the cluster secret."""
    host = sim_host(SimConfig(role="decode", worker_id="d-health"))
    worker = await start_worker_server(host, "127.0.0.1", 0, secret=ClusterSecret(b"s" * 32))
    target = f"grpc://127.0.0.1:{worker.port}"

    def check() -> int:
        return main(["health", "--healthcheck", target, "--health-timeout-s", "2"])

    try:
        assert await asyncio.to_thread(check) == 0
        await worker.state.start_drain()
        assert await asyncio.to_thread(check) == 1
    finally:
        await worker.drain(1.0)
    gone = await asyncio.to_thread(probe, HealthTarget.parse(target), 1.0)
    assert not gone.healthy and "UNAVAILABLE" in gone.detail
