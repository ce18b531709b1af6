"""The tenants' shared limit state (``tenants/ledger.py``): two processes that map one
ledger enforce one tenant's ``max_concurrent`` and token bucket together, exactly; a
process that dies holding slots does not hold them for ever; a request that fails or
samples ``n`` sequences holds and frees the right number of slots."""

from __future__ import annotations

import os
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from unit.fakes import FakeDispatcher, cmpl_body, make_router_app

from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.tenants.accounts import tenant_accounts
from pdserve.router.http.tenants.ledger import TenantLedger, ledger_path
from pdserve.router.http.tenants.limits import TenantLimiter
from pdserve.router.http.tenants.table import TenantLimits, TenantSpec

ONE = TenantLimits(max_concurrent=1)


@pytest.fixture
def ledger(tmp_path: Path) -> Iterator[Path]:
    path = ledger_path(tmp_path)
    TenantLedger.create(path, num_tenants=2, num_slots=2)
    yield path
    path.unlink(missing_ok=True)


# A router process: maps the ledger, takes ``num`` slots of ``tenant`` (limit 2) and says
# so; then "release" frees them, "exit" ends it (a SIGKILL: it dies holding them).
_HOLDER = """
import sys
from pathlib import Path
from pdserve.router.http.tenants.ledger import TenantLedger
from pdserve.router.http.tenants.limits import TenantLimiter
from pdserve.router.http.tenants.table import TenantLimits
try:
    ledger = TenantLedger.open(Path(sys.argv[1]), 2)
except ValueError as exc:
    print("error:", exc, flush=True)
    sys.exit(0)
limiter = TenantLimiter(TenantLimits(max_concurrent=2), ledger=ledger, index=int(sys.argv[2]))
num = int(sys.argv[3])
print("held" if limiter.acquire(num) is None else "refused", flush=True)
for line in sys.stdin:
    if line.strip() == "release":
        limiter.release(num)
        print("released", flush=True)
    else:
        break
"""


class Holder:
    """Another process on the ledger (a fresh interpreter: nothing inherited)."""

    def __init__(self, path: Path, tenant: int, num: int) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _HOLDER, str(path), str(tenant), str(num)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.first = self.line()

    def line(self, timeout_s: float = 30.0) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "the other process did not answer"
        return self.proc.stdout.readline().strip()

    def tell(self, what: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(what + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def holders() -> Iterator[list[Holder]]:
    started: list[Holder] = []
    yield started
    for holder in started:
        holder.stop()


def test_two_processes_enforce_one_max_concurrent_together(
        ledger: Path, holders: list[Holder]) -> None:
    here = TenantLimiter(ONE, ledger=TenantLedger.open(ledger, 2), index=0)
    other = Holder(ledger, 0, 1)  # the other process runs tenant 0's one
    holders.append(other)
    assert other.first == "held"
    refusal = here.acquire()
    assert refusal is not None and refusal.reason == "concurrency"
    assert here.num_running == 1
    other_tenant = TenantLimiter(ONE, ledger=TenantLedger.open(ledger, 2), index=1)
    assert other_tenant.acquire() is None  # tenant 1 is another tenant: its own count
    other_tenant.release()
    other.tell("release")
    assert other.line() == "released"
    assert here.num_running == 0
    assert here.acquire() is None and here.num_running == 1
    here.release()
    assert here.num_running == 0


def test_a_process_that_dies_holding_slots_frees_them_and_its_successor_starts_clean(
        ledger: Path, holders: list[Holder]) -> None:
    ours = TenantLedger.open(ledger, 2, reclaim_every_s=0.5)
    here = TenantLimiter(TenantLimits(max_concurrent=2), ledger=ours)
    dead = Holder(ledger, 0, 2)
    holders.append(dead)
    assert dead.first == "held"
    assert here.num_running == 2 and here.acquire() is not None  # while it lives: full
    dead.stop()  # SIGKILL: it never released
    assert here.num_running == 2
    # Refusals check the owners at most every 0.5 s: the one just now did.
    assert here.acquire() is not None and here.num_running == 2
    time.sleep(0.5)
    # The next refusal checks them: the dead one's two slots are freed.
    assert here.acquire() is None and here.num_running == 1
    here.release()
    # A successor takes the dead process's column, zeroed, and holds its own two.
    successor = Holder(ledger, 0, 2)
    holders.append(successor)
    assert successor.first == "held" and here.num_running == 2


def test_every_column_with_a_live_owner_refuses_one_more_process(
        ledger: Path, holders: list[Holder]) -> None:
    first = TenantLedger.open(ledger, 2)
    holders.append(Holder(ledger, 1, 1))
    third = Holder(ledger, 0, 1)
    holders.append(third)
    assert third.first.startswith("error:") and "live owner" in third.first
    first.close()
    with pytest.raises(ValueError, match="not a tenant ledger of 3"):
        TenantLedger.open(ledger, 3)
    with pytest.raises(ValueError, match="cannot open the tenant ledger"):
        TenantLedger.open(ledger.with_name("missing"), 2)


def test_the_token_bucket_is_one_for_every_process(ledger: Path) -> None:
    clock = [100.0]
    limits = TenantLimits(tokens_per_s=10.0, burst=30.0)
    a = TenantLimiter(limits, lambda: clock[0], TenantLedger.open(ledger, 2), 1)
    b = TenantLimiter(limits, lambda: clock[0], TenantLedger(*_reopen(ledger)), 1)
    a.charge(50)  # 20 in debt, charged by one process ...
    refusal = b.acquire()  # ... refuses the other's request
    assert refusal is not None and (refusal.reason, refusal.retry_after_s) == ("tokens", 2)
    clock[0] += 2.0
    assert b.acquire() is None and a.level() == pytest.approx(0.0)


def _reopen(path: Path) -> tuple[Any, int, int]:
    """A second mapping of ``path`` in this process, on a column of its own (as another
    process's: slot 1, whatever its owner)."""
    import mmap

    fd = os.open(path, os.O_RDWR)
    return mmap.mmap(fd, os.fstat(fd).st_size), fd, 1


# ---- through the app: errors, n ----------------------------------------------------------

KEY = "sk-tenant-ledger-01"
EDGE = EdgeConfig(api_keys=(KEY,), tenants=(TenantSpec("acme", (KEY,), TenantLimits(
    max_concurrent=4)),))


def _running(app: Any) -> int:
    limiter = app.state.tenants[KEY.encode()].limiter
    assert limiter is not None
    return int(limiter.num_running)


async def test_n_counts_as_that_many_sequences_and_all_are_freed(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=[5, 6])
    app = make_router_app(tokenizer, fake, EDGE)
    headers = {"Authorization": f"Bearer {KEY}"}
    held = app.state.tenants[KEY.encode()].limiter
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        too_many = await http.post("/v1/completions", json=cmpl_body(n=5), headers=headers)
        assert too_many.status_code == 400  # 5 sequences never fit a limit of 4
        assert too_many.json()["error"]["param"] == "n"
        assert held.acquire(2) is None  # 2 of 4 taken elsewhere: n=3 does not fit now
        busy = await http.post("/v1/completions", json=cmpl_body(n=3), headers=headers)
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        assert _running(app) == 2  # the refused request holds nothing
        fits = await http.post("/v1/completions", json=cmpl_body(n=2), headers=headers)
        assert fits.status_code == 200 and len(fits.json()["choices"]) == 2
        assert _running(app) == 2  # its two sequences freed
        held.release(2)
    assert _running(app) == 0 and len(fake.calls) == 2  # n=2: one call per choice


async def test_a_failed_request_frees_its_slots(tokenizer: Any) -> None:
    fake = FakeDispatcher(output_ids=[5, 6], error_before_first=RuntimeError("boom"))
    app = make_router_app(tokenizer, fake, EDGE)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://test") as http:
        for n in (1, 3):
            reply = await http.post("/v1/completions", json=cmpl_body(n=n),
                                    headers={"Authorization": f"Bearer {KEY}"})
            assert reply.status_code >= 500
            assert _running(app) == 0


def test_one_router_process_keeps_its_ledger_in_its_own_memory() -> None:
    accounts = tenant_accounts(EDGE, None)
    limiter = accounts[KEY.encode()].limiter
    assert limiter is not None and limiter.acquire(4) is None and limiter.acquire() is not None
