"""Several routers, as real processes, in front of simulated workers (no vLLM):

- ``pdserve router --processes 2``: two processes on one port; both take connections,
  each follows the prefill worker's KV events itself, the admission limits are split;
  SIGTERM stops them all.
- Two router replicas on etcd with ``--planner on``: both serve and index the same KV
  events; exactly one leads the planner; SIGKILL of the leader mid-stream loses only
  its own streams (the other's finish whole) and the survivor leads within one TTL.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest

from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.core.ports import free_port
from pdserve.membership.local_etcd import LocalEtcd

PY = (sys.executable, "-m", "pdserve.cli.main")
MODEL = "SmolLM2-135M-Instruct"
TTL_S = 2


def sim(role: str, port: int, log_dir: Path, *extra: str) -> Proc:
    return Proc(f"sim-{role}-{port}", (*PY, "sim-worker", "--role", role, "--port", str(port),
                                        "--block-size", "4", "--decode-ms-per-token", "10",
                                        "--log-level", "WARNING", *extra),
                log_dir / f"sim-{role}-{port}.log", f"grpc:127.0.0.1:{port}")


def router(name: str, port: int, admin: int, log_dir: Path, *extra: str) -> Proc:
    return Proc(name, (*PY, "router", "--port", str(port), "--admin-port", str(admin),
                       "--disagg", "always", "--placement", "cache_aware", "--log-level",
                       "WARNING", *extra),
                log_dir / f"{name}.log", f"http://127.0.0.1:{admin}/health")


def body(i: int, max_tokens: int = 4) -> dict[str, object]:
    return {"model": MODEL, "prompt": f"request {i}: " + "the same long prefix " * 8,
            "max_tokens": max_tokens, "stream": True, "ignore_eos": True}


def stream(port: int, i: int, max_tokens: int = 4) -> str:
    """One streamed completion on a connection of its own; the SSE body."""
    with httpx.Client(timeout=30) as http:
        reply = http.post(f"http://127.0.0.1:{port}/v1/completions", json=body(i, max_tokens))
        reply.raise_for_status()
        return reply.text


def num_served(admin: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:http_requests_total{endpoint=\"/v1/completions\""))


def indexed_blocks(admin: int) -> int:
    blocks = httpx.get(f"http://127.0.0.1:{admin}/prefix_index", timeout=5).json()["blocks"]
    return sum(blocks.values())


def planner(admin: int) -> dict[str, object]:
    return httpx.get(f"http://127.0.0.1:{admin}/workers", timeout=5).json()["planner"]


def wait_for(what: str, condition: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout_s} s")
        time.sleep(0.1)


@pytest.fixture
def log_dir(tmp_path: Path) -> Path:
    return tmp_path


def test_two_router_processes_share_one_port_and_each_follows_the_kv_events(
        log_dir: Path) -> None:
    p, d, port, admin = free_port(), free_port(), free_port(), free_port()
    free_port()  # admin + 1 is process 1's; taken here so nothing else gets it meanwhile
    procs = [sim("prefill", p, log_dir), sim("decode", d, log_dir),
             router("routers", port, admin, log_dir, "--prefill", f"127.0.0.1:{p}",
                    "--decode", f"127.0.0.1:{d}", "--processes", "2",
                    "--max-concurrent-requests", "7", "--max-queued-requests", "3")]
    with ProcGroup(procs) as group:
        group.wait_ready(120)
        wait_for("process 1's admin listener", lambda: _up(admin + 1), 60)
        for i in range(48):  # a new connection each: the kernel spreads them
            assert stream(port, i).endswith("data: [DONE]\n\n")
        served = [num_served(admin), num_served(admin + 1)]
        assert sum(served) == 48 and min(served) > 0, served
        # Each process indexed the prefill's KV events itself: even the blocks of
        # prompts the other one placed.
        wait_for("KV events in both", lambda: min(indexed_blocks(admin),
                                                  indexed_blocks(admin + 1)) > 0)
        assert indexed_blocks(admin) == indexed_blocks(admin + 1)
        router_proc = group.procs["routers"]
        limits = [_flag(c.cmdline(), "--max-concurrent-requests")
                  for c in psutil.Process(router_proc.pid).children()]
        assert sorted(limits) == [3, 4], limits  # 7 running split 4 + 3
        router_proc.send_signal(signal.SIGTERM)
        assert router_proc.wait(timeout=30) == 0
        wait_for("both processes gone", lambda: not _up(admin) and not _up(admin + 1))


def test_two_replicas_on_etcd_share_kv_events_and_one_planner_that_moves(
        log_dir: Path) -> None:
    with LocalEtcd(log_dir / "etcd.log") as etcd:
        membership = ("--etcd", etcd.url, "--cluster", "scale", "--etcd-ttl-s", str(TTL_S))
        p, d = free_port(), free_port()
        ports = [free_port(), free_port()]
        admins = [free_port(), free_port()]
        procs = [sim("prefill", p, log_dir, *membership), sim("decode", d, log_dir, *membership),
                 *(router(f"router-{i}", ports[i], admins[i], log_dir, *membership,
                          "--planner", "on") for i in range(2))]
        with ProcGroup(procs) as group:
            group.wait_ready(120)
            for i in range(8):
                assert stream(ports[i % 2], i).endswith("data: [DONE]\n\n")
            assert min(num_served(a) for a in admins) == 4
            wait_for("KV events in both", lambda: min(indexed_blocks(a) for a in admins) > 0)
            wait_for("one planner leader",
                     lambda: sum(bool(planner(a)["leader"]) for a in admins) == 1)
            lead = 0 if planner(admins[0])["leader"] else 1
            other = 1 - lead
            # Long streams on both; the leader's router dies mid-stream.
            results = asyncio.run(_kill_mid_stream(group, ports, lead, f"router-{lead}"))
            assert all(r.endswith("data: [DONE]\n\n") for r in results[other]), results[other]
            assert all(not r.endswith("data: [DONE]\n\n") for r in results[lead])
            killed_at = time.monotonic()
            wait_for("the survivor leads", lambda: bool(planner(admins[other])["leader"]),
                     TTL_S + 8.0)
            assert time.monotonic() - killed_at < TTL_S + 8.0
            assert stream(ports[other], 99).endswith("data: [DONE]\n\n")


async def _kill_mid_stream(group: ProcGroup, ports: list[int], lead: int, name: str
                           ) -> list[list[str]]:
    """Four 60-token streams on each router (10 ms a token); SIGKILL ``name`` once every
    stream has its first tokens. Each stream's SSE body, as far as it got."""
    results: list[list[str]] = [[], []]
    started = asyncio.Event()
    num_started = 0

    async def one(router_index: int, i: int) -> None:
        nonlocal num_started
        text = ""
        try:
            async with httpx.AsyncClient(timeout=30) as http, http.stream(
                    "POST", f"http://127.0.0.1:{ports[router_index]}/v1/completions",
                    json=body(100 + i, 60)) as reply:
                async for chunk in reply.aiter_text():
                    if not text:
                        num_started += 1
                        if num_started == 8:
                            started.set()
                    text += chunk
        except httpx.HTTPError:
            pass
        results[router_index].append(text)

    tasks = [asyncio.create_task(one(r, 10 * r + i)) for r in (0, 1) for i in range(4)]
    await asyncio.wait_for(started.wait(), 30)
    group.procs[name].send_signal(signal.SIGKILL)
    await asyncio.gather(*tasks)
    return results


def _up(admin: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{admin}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _flag(argv: list[str], name: str) -> int:
    """The last value of ``name`` on a command line (the one argparse keeps)."""
    return int(argv[len(argv) - 1 - argv[::-1].index(name) + 1])
