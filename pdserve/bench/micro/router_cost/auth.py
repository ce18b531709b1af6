"""``pdserve bench router-cost --auth none secret ...``: the latency part without and with
a cluster secret on every process, side by side (medians over each mode's runs), and what
the router's own authentication work costs per signed call, measured in process (a
number other processes on a shared machine cannot inflate)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_auth import CallAuth
from pdserve.core.grpc_proofs import PROOF_HEADER, worker_proof

AUTH_COMPARED = ("router_cpu_ms_per_request", "router_cpu_us_per_chunk", "router_cpu_pct",
                 "req_per_s", "added_p50_ms")


def run_auth(cfg: RouterCostConfig,
             run_latency: Callable[[RouterCostConfig, str], dict[str, float]]
             ) -> dict[str, object]:
    """One ``run_latency`` per ``cfg.auth`` entry; with both modes, the medians side by side."""
    runs: dict[str, list[dict[str, float]]] = {}
    for auth in cfg.auth:
        runs.setdefault(auth, []).append(run_latency(cfg, auth))
    if len(runs) == 1:
        return dict(next(iter(runs.values()))[-1])
    medians = {mode: {k: statistics.median(r[k] for r in rs) for k in AUTH_COMPARED}
               for mode, rs in runs.items()}
    print(f"auth side by side (median of {', '.join(f'{len(r)} {m}' for m, r in runs.items())}"
          " runs):")
    print(f"  {'':28s} {'none':>10s} {'secret':>10s} {'secret/none':>12s}")
    for key in AUTH_COMPARED:
        none, secret = medians["none"][key], medians["secret"][key]
        ratio = secret / none if none else float("nan")
        print(f"  {key:28s} {none:10.3f} {secret:10.3f} {ratio:12.3f}")
    per_call = auth_work_us()
    print(f"  the router's auth work per signed call, in process: {per_call:.1f} us (sign + "
          "check the answer's proof); one per Session opened and per unary call, none per "
          "token")
    return {"auth": {"runs": runs, "medians": medians, "auth_work_us_per_call": per_call}}


def auth_work_us(calls: int = 20_000) -> float:
    """What ``CallAuth`` costs the router per signed call (sign, then verify a proof)."""
    secret = ClusterSecret(b"bench-secret-0123456789abcdef")
    auth = CallAuth(secret, "bench", "w0")
    method = "/pdserve.v1.WorkerService/Session"
    answer = ((PROOF_HEADER, worker_proof(secret, "w0", method, "0" * 32)),)
    start = time.process_time()
    for _ in range(calls):
        auth.sign(method)
        auth.verify(method, "0" * 32, answer)
    return 1e6 * (time.process_time() - start) / calls
