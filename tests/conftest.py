"""Puts tests/ on sys.path so the shared helpers module (``pdserve_testing``) is
importable from test modules and from the processes they spawn; skips the tests marked
``gpu`` where there is no CUDA/ROCm device. The only other skip the suite allows is
``tests/hosts``' where the machine cannot make network namespaces (not root), with the
reason; a test that needs anything else the install provides fails where it is missing."""

import asyncio
import io
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.bench.hosts import HostNet, sweep, unavailable

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


# A hung await shows as an idle event loop in pytest-timeout's thread dump, which
# says nothing about where. Unit tests get a shorter timeout (a hang costs CI 5 min,
# not 15), and shortly before any test's timeout every pending asyncio task's stack
# is printed, so the await that never returned is named in the CI log.
UNIT_TIMEOUT_S = 300.0
DUMP_BEFORE_TIMEOUT_S = 10.0


NO_GPU = pytest.mark.skip(reason="gpu test: no CUDA/ROCm device on this machine")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "/unit/" in str(item.path) and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(UNIT_TIMEOUT_S))
        if item.get_closest_marker("gpu") is not None and not has_gpu:
            item.add_marker(NO_GPU)


def _dump_asyncio_tasks(nodeid: str) -> None:
    tasks = [t for t in list(asyncio.tasks._all_tasks) if not t.done()]  # type: ignore[attr-defined]
    out = io.StringIO()
    print(f"\n=== {nodeid}: {len(tasks)} pending asyncio tasks near the timeout ===", file=out)
    for task in tasks:
        print(f"-- {task.get_name()}:", file=out)
        try:
            print("".join(_await_chain(task.get_coro())), end="", file=out)
        except Exception as exc:  # noqa: BLE001 - a diagnostic must never raise
            print(f"   stack unavailable ({exc})", file=out)
    sys.stderr.write(out.getvalue())
    sys.stderr.flush()


def _await_chain(coro: object) -> list[str]:
    """Where a task waits: each coroutine it awaits, down to the innermost one (a
    task's own stack stops at its outermost coroutine)."""
    lines = []
    for _ in range(64):
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None) \
            or getattr(coro, "ag_frame", None)
        if frame is not None:
            lines.append(f"   {frame.f_code.co_filename}:{frame.f_lineno} in "
                         f"{frame.f_code.co_name}\n")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None) \
            or getattr(coro, "ag_await", None)
        if coro is None:
            break
        if frame is None:
            lines.append(f"   awaiting {coro!r}\n")
    return lines


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    marker = item.get_closest_marker("timeout")
    timeout_s = float(marker.args[0]) if marker and marker.args else float(
        item.config.getini("timeout") or 0)
    timer = None
    if timeout_s > DUMP_BEFORE_TIMEOUT_S:
        timer = threading.Timer(timeout_s - DUMP_BEFORE_TIMEOUT_S, _dump_asyncio_tasks,
                                args=(item.nodeid,))
        timer.daemon = True
        timer.start()
    try:
        yield
    finally:
        if timer is not None:
            timer.cancel()


@pytest.fixture(scope="session")
def hosts_available() -> None:
    """Hosts can be made here (``pdserve.bench.hosts``), or the test is skipped with the
    reason (``-ra`` prints it); what an earlier run killed before its cleanup left is
    removed first."""
    reason = unavailable()
    if reason:
        pytest.skip(f"no hosts on this machine: {reason}")
    sweep()


@pytest.fixture
def hostnet(hosts_available: None) -> Iterator[HostNet]:
    """Hosts of the test's own, removed after it, even when it fails."""
    with HostNet() as net:
        yield net

