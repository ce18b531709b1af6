"""``pdserve router --processes N`` (``launch/router_processes.py``): each process's
command line, the limits' split, and the refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pdserve.launch.router_processes import check, child_argv, share
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.server import RouterConfig


def config(**edge: object) -> RouterConfig:
    return RouterConfig("m", "m", ("p:1",), ("d:1",), edge=EdgeConfig(**edge))  # type: ignore[arg-type]


@pytest.mark.parametrize(("total", "num"), [(7, 2), (256, 4), (0, 3), (5, 5), (1024, 3)])
def test_the_shares_add_up_to_the_limit_and_differ_by_one_at_most(total: int, num: int) -> None:
    parts = [share(total, num, i) for i in range(num)]
    assert sum(parts) == total and max(parts) - min(parts) <= 1


def test_each_process_gets_its_share_its_admin_port_and_only_the_first_the_planner() -> None:
    argv = ["router", "--port", "8000", "--planner", "on", "--admin-port", "9000"]
    cfg = config(max_concurrent=7, max_queued=3, admin_port=9000)
    ledger = Path("/dev/shm/pdserve-tenants-x")
    lines = [child_argv(argv, cfg, 2, i, ledger) for i in range(2)]
    for i, line in enumerate(lines):
        assert line[line.index("router"):][:len(argv)] == argv  # the router's own first
        tail = line[line.index("router") + len(argv):]
        assert tail[:3] == ["--processes", "1", "--reuse-port"]
        assert tail[tail.index("--admin-port") + 1] == str(9000 + i)
    assert [ln[ln.index("--max-concurrent-requests") + 1] for ln in lines] == ["4", "3"]
    assert [ln[ln.index("--max-queued-requests") + 1] for ln in lines] == ["2", "1"]
    # The tenants' limits are not split: every process maps the one ledger.
    assert [ln[ln.index("--tenant-ledger") + 1] for ln in lines] == [str(ledger)] * 2
    assert all("--tenant-limits-share" not in ln for ln in lines)
    assert "--planner" not in lines[0][lines[0].index("--reuse-port"):]
    assert lines[1][-2:] == ["--planner", "off"]
    # The planner's process sees half of the requests: it plans for twice its demand.
    assert lines[0][-2:] == ["--planner-demand-scale", "2.0"]
    no_admin = child_argv(argv, config(), 2, 1, ledger)
    assert no_admin[no_admin.index("--admin-port", len(no_admin) - 8) + 1] == "0"


def test_more_processes_than_running_slots_or_an_explicit_reuse_port_is_refused() -> None:
    with pytest.raises(ValueError, match="max-concurrent-requests >= 3"):
        check(config(max_concurrent=2), 3)
    with pytest.raises(ValueError, match="reuse-port"):
        check(dataclasses.replace(config(), reuse_port=True), 2)
