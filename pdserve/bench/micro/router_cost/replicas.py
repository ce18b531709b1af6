"""``pdserve bench router-cost --parts replicas``: do two routers active-active place as
well as one? The prefix hit rate of the same two request streams through one router and
through two, on the same simulated workers.

Each layout gets a fresh cluster (cold caches): two sim prefill workers and one sim
decode, with modelled prefill time, and two routers (``--disagg always``, the default
cache-aware placement). Two ``pdserve bench run`` clients send the ``shared-prefix``
workload (seeds 0 and 1, ``--replica-requests`` each): both to router A (one router),
or one to each (two routers, each following every worker's KV events but not the other
router's placements in flight). The hit rate is the responses' cached tokens over their
prompt tokens, both clients together. Target: two routers within 2 points of one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.bench.micro.procs import Proc, ProcGroup
from pdserve.core.model import new_log_dir
from pdserve.core.ports import free_port

PY = (sys.executable, "-m", "pdserve.cli.main")
SEEDS = (0, 1)
LAYOUTS = (("one router", ("ra", "ra")), ("two routers", ("ra", "rb")))


def _procs(log_dir: Path, ports: dict[str, int]) -> list[Proc]:
    sims = [Proc(name, (*PY, "sim-worker", "--role", role, "--port", str(ports[name]),
                        "--worker-id", name, "--num-blocks", "4096",
                        "--prefill-us-per-token", "200", "--decode-ms-per-token", "5",
                        "--log-level", "WARNING"),
                 log_dir / f"{name}.log", f"grpc:127.0.0.1:{ports[name]}")
            for name, role in (("p0", "prefill"), ("p1", "prefill"), ("d0", "decode"))]
    workers = ("--prefill", f"127.0.0.1:{ports['p0']},127.0.0.1:{ports['p1']}",
               "--decode", f"127.0.0.1:{ports['d0']}")
    routers = [Proc(name, (*PY, "router", "--port", str(ports[name]), *workers,
                           "--disagg", "always", "--log-level", "WARNING"),
                    log_dir / f"{name}.log", f"http://127.0.0.1:{ports[name]}/health")
               for name in ("ra", "rb")]
    return [*sims, *routers]


def _client(port: int, seed: int, requests: int, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [*PY, "bench", "run", "--base-url", f"http://127.0.0.1:{port}",
         "--workload", "shared-prefix", "--num-requests", str(requests),
         "--request-rate", "15", "--output-len", "4", "--num-system-prompts", "6",
         "--system-prompt-len", "600", "--num-users", "30", "--seed", str(seed),
         "--result-json", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def hit_rate(results: list[dict[str, float]]) -> float:
    """Cached over prompt tokens of every completed request of ``results`` together."""
    prompt = sum(r["input_tokens"] for r in results)
    return sum(r["cached_tokens"] for r in results) / prompt if prompt else 0.0


def run_replicas(cfg: RouterCostConfig) -> dict[str, float]:
    log_dir = new_log_dir("bench-router-replicas-")
    rates: dict[str, float] = {}
    for layout, targets in LAYOUTS:
        ports = {name: free_port() for name in ("p0", "p1", "d0", "ra", "rb")}
        with ProcGroup(_procs(log_dir / layout.replace(" ", "-"), ports)) as group:
            group.wait_ready(120)
            time.sleep(2.0)  # the routers' KV-event followers connect
            outs = [log_dir / f"{layout.replace(' ', '-')}-{seed}.json" for seed in SEEDS]
            clients = [_client(ports[t], seed, cfg.replica_requests, out)
                       for t, seed, out in zip(targets, SEEDS, outs, strict=True)]
            for client in clients:
                _, err = client.communicate()
                if client.returncode != 0:
                    raise RuntimeError(f"bench run failed: {err.decode()[-2000:]}")
            rates[layout] = hit_rate([json.loads(o.read_text()) for o in outs])
        print(f"(e) {layout}: prefix hit rate {100 * rates[layout]:.1f} % "
              f"(logs in {log_dir})", flush=True)
    points = 100 * (rates["two routers"] - rates["one router"])
    print(f"(e) two routers active-active: {points:+.1f} points against one (target: within "
          "2 points)", flush=True)
    return {"one_router_hit_rate": rates["one router"],
            "two_routers_hit_rate": rates["two routers"], "difference_points": points}
