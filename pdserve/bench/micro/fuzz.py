"""``pdserve bench fuzz``: bad input on the KV port (``pdserve.bench.fuzz``).

By default two tcp transports on fake KV tensors in this process, as a worker runs
them (leases, a push inbox, a pool), one open and one with a cluster secret, each
fuzzed with ``--inputs`` inputs; with ``--target HOST:PORT``, a worker's KV port.
Prints one row per port (crashes, answers, leaks, liveness) and the outcomes per
input class; exits 1 if any port crashed, held a connection, leaked or failed its
liveness check.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pdserve.bench.fuzz.kv_driver import KvTarget, PortReport, fuzz_port
from pdserve.bench.fuzz.kv_remote import RemoteTarget
from pdserve.bench.fuzz.kv_target import InProcessTarget
from pdserve.bench.fuzz.kv_watch import wait_threads
from pdserve.bench.fuzz.report import as_json, render
from pdserve.bench.micro.configs import FuzzConfig
from pdserve.core.cluster_secret import ClusterSecret, optional_secret


def _fuzz(target: KvTarget, config: FuzzConfig, max_stalls: int | None) -> PortReport:
    try:
        return fuzz_port(target, config.inputs, config.seed, config.concurrency, max_stalls)
    finally:
        target.close()


def run(config: FuzzConfig) -> int:
    reports = []
    if config.target is not None:
        host, port = config.address
        remote = RemoteTarget(host, port, optional_secret(config.cluster_secret_file),
                              config.stall_deadline_s or 0.0)
        reports.append(_fuzz(remote, config, None if config.stall_deadline_s else 0))
    else:
        for label, secret in (("kv", None),
                              ("kv+secret", ClusterSecret(os.urandom(32), "<fuzz>"))):
            reports.append(_fuzz(InProcessTarget(label, secret, config.idle_timeout_s,
                                                 config.seed), config, None))
    # The transports' threads end before the interpreter does (the accept loop polls once
    # a second): one still inside torch at exit can abort the process (seen once, rc 134).
    wait_threads(0, 3.0, prefix="pdserve-kv")
    print(render(reports))
    if config.json:
        Path(config.json).write_text(json.dumps([as_json(r) for r in reports], indent=2))
    return 0 if all(r.passed for r in reports) else 1
