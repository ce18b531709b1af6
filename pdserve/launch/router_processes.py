"""``pdserve router --processes N``: N router processes behind one port.

One Python process streams a few thousand tokens per second before its core is full
(the GIL: one core per process). Each process here is a whole router: it binds the same
port with SO_REUSEPORT (the kernel gives each new connection to one of them), follows
membership and every worker's KV events itself, and keeps its own sessions to the
workers. The global admission limits hold by splitting them: process ``i`` admits its
share of ``--max-concurrent-requests`` and ``--max-queued-requests``. The tenants'
limits hold exactly, whole: this process creates their state (a ``TenantLedger``, a
small file in ``/dev/shm``) before it starts the processes, and every process maps it
(``--tenant-ledger``) and counts each tenant's sequences and tokens there, under a lock
held for microseconds; a process that dies frees its slots (``tenants/ledger.py``).
The ledger file goes when this process ends. So does the weights board
(``--weight-board``, ``dispatch/weight_board.py``), made the same way: a weight update or
vLLM's ``/pause`` through any process closes every process's gate, drains or aborts every
process's requests, commits once, and every process admits under the new version.
Each process serves its admin listener (its ``/metrics``: one scrape target per
process, summed by Prometheus) on ``--admin-port + i``, and only process 0 may run
(or campaign for) the planner.

This process only supervises: each child is the same command line with those
overrides, restarted if it dies (``supervisor.py``); SIGTERM drains them all.
"""

from __future__ import annotations

import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from pdserve.launch.supervisor import ChildSpec, RestartPolicy, Supervisor
from pdserve.router.dispatch.weight_board import WeightBoard
from pdserve.router.http.tenants.accounts import num_tenants
from pdserve.router.http.tenants.ledger import TenantLedger, ledger_path
from pdserve.router.server import RouterConfig

logger = logging.getLogger("pdserve.router")
_POLL_S = 0.5
_STDERR = Path("/proc/self/fd/2")  # opened (appending) by this process: its own stderr


def share(total: int, num: int, index: int) -> int:
    """Process ``index``'s part of a limit of ``total`` split ``num`` ways (they add up)."""
    return total // num + (1 if index < total % num else 0)


def child_argv(argv: Sequence[str], config: RouterConfig, num: int, index: int,
               ledger: Path, board: Path | None = None) -> list[str]:
    """Process ``index``'s command line: the router's own, then its overrides (argparse
    keeps the last value of a flag, and a flag wins over ``PDSERVE_*``)."""
    edge = config.edge
    overrides = ["--processes", "1", "--reuse-port",
                 "--max-concurrent-requests", str(share(edge.max_concurrent, num, index)),
                 "--max-queued-requests", str(share(edge.max_queued, num, index)),
                 "--tenant-ledger", str(ledger),
                 *(("--weight-board", str(board)) if board is not None else ()),
                 "--admin-port", str(edge.admin_port + index if edge.admin_port else 0)]
    if index > 0:
        overrides += ["--planner", "off"]
    else:  # the planner's process sees 1/num of this router's requests
        overrides += ["--planner-demand-scale", repr(config.planner.demand_scale * num)]
    return [sys.executable, "-m", "pdserve.cli.main", *argv, *overrides]


def check(config: RouterConfig, num: int) -> None:
    if config.edge.max_concurrent < num:
        raise ValueError(f"--processes {num} needs --max-concurrent-requests >= {num} "
                         f"(each process admits its share), not {config.edge.max_concurrent}")
    if config.reuse_port:
        raise ValueError("--processes sets --reuse-port for each of its processes; "
                         "give one or the other")


def run_router_processes(argv: Sequence[str], config: RouterConfig, num: int,
                         log_dir: Path | None = None) -> int:
    """Start ``num`` routers on ``config.port`` and keep them running until SIGTERM or
    SIGINT (then drain and stop them all). Their output is this process's."""
    check(config, num)
    ledger = ledger_path()
    board = ledger.with_name(ledger.name.replace("pdserve-tenants-", "pdserve-weights-"))
    TenantLedger.create(ledger, num_tenants(config.edge), num)
    WeightBoard.create(board, num)
    try:
        return _supervise(argv, config, num, log_dir, ledger, board)
    finally:
        ledger.unlink(missing_ok=True)
        board.unlink(missing_ok=True)


def _supervise(argv: Sequence[str], config: RouterConfig, num: int, log_dir: Path | None,
               ledger: Path, board: Path) -> int:
    specs = [ChildSpec(f"router-{i}", child_argv(argv, config, num, i, ledger, board),
                       log_dir / f"router-{i}.log" if log_dir else _STDERR,
                       fresh_log=log_dir is not None) for i in range(num)]
    supervisor = Supervisor(specs, RestartPolicy())
    stopping: list[int] = []

    def on_signal(sig: int, frame: FrameType | None) -> None:
        stopping.append(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    supervisor.start()
    logger.info("%d router processes on http://%s:%d (admission %d + %d queued each, "
                "or one more)", num, config.host, config.port,
                config.edge.max_concurrent // num, config.edge.max_queued // num)
    while not stopping:
        for event in supervisor.poll():
            if event.kind == "gave_up":
                logger.error("%s keeps failing; stopping every router process", event.name)
                stopping.append(0)
        time.sleep(_POLL_S)
    report = supervisor.stop(config.edge.drain_timeout_s + 5.0)
    return 0 if not report.left_behind else 1
