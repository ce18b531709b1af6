"""Per-tenant limits hold exactly across ``pdserve router --processes 2``: two tenants
with ``max_concurrent=1`` never run more than one request each at a time, whichever of
the two router processes (one port, SO_REUSEPORT) took each connection.

Real router processes and real sockets; the workers are simulated (no vLLM) and run in
this process, over real gRPC, so that each request's span is recorded on the workers'
side, where it runs: from the moment the prefill worker gets it (after the router
admitted it) to the moment the decode worker makes its last token (before the router
can end its response and free its slot). Spans are within the router's slot-holding
intervals, so any overlap of two of one tenant's spans is a breach of its limit.
"""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.core.ports import free_port
from pdserve.core.types import PhaseOutput, PhaseRequest, Role
from pdserve.launch.sim_worker import sim_role_policy
from pdserve.worker.host import EngineHost
from pdserve.worker.servicer import WorkerServer, start_worker_server
from pdserve.worker.sim.engine import SimConfig, SimEngine

PY = (sys.executable, "-m", "pdserve.cli.main")
MODEL = "SmolLM2-135M-Instruct"
KEYS = {"acme": "sk-acme-processes-01", "beta": "sk-beta-processes-02"}
NUM_WAVES = 8
PER_WAVE = 8  # concurrent requests of each tenant in a wave, each on its own connection
MAX_TOKENS = 12  # at 10 ms a token: each admitted request runs >= 120 ms
_TENANT = re.compile(r"^cmpl-(acme|beta)-")


class RecordingHost(EngineHost):
    """A simulated worker that notes when each request reaches it (prefill) or makes
    its last token (decode), by the test's monotonic clock."""

    def __init__(self, config: SimConfig, marks: dict[str, float]) -> None:
        super().__init__(config.engine_config, config.worker_id, sim_role_policy(config.role),
                         lambda _, counters: SimEngine(config, counters))
        self.marks = marks
        self.start()

    async def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        role = self.policy.role
        if role == "prefill":
            self.marks[request.request_id] = time.monotonic()
        async for out in super().generate(request):
            if role == "decode" and out.finish_reason is not None:
                self.marks[request.request_id] = time.monotonic()
            yield out


class Workers:
    """A prefill and a decode worker on an event loop of their own (a thread)."""

    def __init__(self) -> None:
        self.starts: dict[str, float] = {}
        self.ends: dict[str, float] = {}
        self.ports: list[int] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._servers: list[WorkerServer] = []

    def __enter__(self) -> Workers:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            for worker in self._servers:
                await worker.server.stop(0)

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _start(self) -> None:
        role: Role
        for role, marks in (("prefill", self.starts), ("decode", self.ends)):
            config = SimConfig(role, f"{role}-0", block_size=4, decode_s_per_token=0.01)
            worker = await start_worker_server(RecordingHost(config, marks), "127.0.0.1", 0)
            self._servers.append(worker)
            self.ports.append(worker.port)


@pytest.fixture
def workers() -> Iterator[Workers]:
    with Workers() as running:
        yield running


def spans(workers: Workers) -> dict[str, list[tuple[float, float]]]:
    """Each tenant's requests' [start, end] on the workers, by start."""
    out: dict[str, list[tuple[float, float]]] = {"acme": [], "beta": []}
    for request_id, end in workers.ends.items():
        match = _TENANT.match(request_id)
        assert match is not None and request_id in workers.starts, request_id
        out[match.group(1)].append((workers.starts[request_id], end))
    return {tenant: sorted(found) for tenant, found in out.items()}


async def one(port: int, tenant: str, i: int) -> httpx.Response:
    """One streamed completion on a connection of its own (the kernel spreads them)."""
    body = {"model": MODEL, "prompt": f"{tenant} request {i}", "max_tokens": MAX_TOKENS,
            "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEYS[tenant]}", "X-Request-Id": f"{tenant}-{i}"}
    async with httpx.AsyncClient(timeout=60) as http:
        reply = await http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                headers=headers)
        if reply.status_code == 200:
            assert reply.text.endswith("data: [DONE]\n\n")
        return reply


async def waves(port: int) -> list[httpx.Response]:
    replies: list[httpx.Response] = []
    for wave in range(NUM_WAVES):
        replies += await asyncio.gather(*(one(port, tenant, wave * PER_WAVE + i)
                                          for i in range(PER_WAVE) for tenant in KEYS))
    return replies


def tenant_admitted(admin: int) -> float:
    """Generation requests this router process admitted for the tenants (sent, less
    refused)."""
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("pdserve:tenant_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("pdserve:tenant_rejections_total{"):
            total -= float(line.rsplit(" ", 1)[1])
    return total


def test_two_tenants_with_max_concurrent_1_never_run_two_at_once_behind_two_processes(
        tmp_path: Path, workers: Workers) -> None:
    keys = tmp_path / "keys"
    keys.write_text("".join(f"{key} tenant={name} max_concurrent=1\n"
                            for name, key in KEYS.items()))
    keys.chmod(0o600)
    prefill, decode = workers.ports
    port, admin = free_port(), free_port()
    free_port()  # admin + 1 is process 1's; taken here so nothing else gets it meanwhile
    router = Proc("routers", (*PY, "router", "--port", str(port), "--admin-port", str(admin),
                              "--prefill", f"127.0.0.1:{prefill}",
                              "--decode", f"127.0.0.1:{decode}", "--disagg", "always",
                              "--processes", "2", "--api-key-file", str(keys),
                              "--log-level", "WARNING"),
                  tmp_path / "routers.log", f"http://127.0.0.1:{admin}/health")
    with ProcGroup([router]) as group:
        group.wait_ready(120)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _up(admin + 1):
            time.sleep(0.1)
        replies = asyncio.run(waves(port))
        admitted = [tenant_admitted(admin), tenant_admitted(admin + 1)]
    ok = [r for r in replies if r.status_code == 200]
    refused = [r for r in replies if r.status_code != 200]
    # Both processes of the pair admitted requests of the tenants: the limit held
    # across them, not within one.
    assert min(admitted) > 0 and sum(admitted) == len(ok), (admitted, len(ok))
    assert refused and all(r.status_code == 429 for r in refused)
    for reply in refused:
        assert reply.headers["retry-after"] == "1"
        assert reply.json()["error"]["code"] == "rate_limit_exceeded"
    by_tenant = spans(workers)
    assert sum(map(len, by_tenant.values())) == len(ok)
    for tenant, found in by_tenant.items():
        assert len(found) >= NUM_WAVES, (tenant, len(found))  # each wave ran one at least
        for (_, end), (start, _) in zip(found, found[1:], strict=False):
            assert start >= end, f"{tenant} ran two requests at once"
    # The limit is each tenant's own: the two tenants did run at the same time.
    assert any(a_start < b_end and b_start < a_end
               for a_start, a_end in by_tenant["acme"] for b_start, b_end in by_tenant["beta"])


def _up(admin: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{admin}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
