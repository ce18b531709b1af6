"""The router's per-worker circuit breaker: repeated failed calls eject a worker from
placement for an exponential back-off; it is readmitted on trial after it, a success
closes the breaker; client-caused failures and deadlines do not count. The breaker
alone on a fake clock, then through the dispatcher against fake workers over gRPC."""

from __future__ import annotations

import grpc
import pytest
from prometheus_client import CollectorRegistry
from unit.dispatch_cluster import PROMPT, collect, spec
from unit.fake_worker import WorkerScript, start_fake_worker
from unit.fakes import Clock

from pdserve.router.dispatch.base import RequestRejectedError, WorkerFailedError
from pdserve.router.dispatch.dispatcher import PDDispatcher
from pdserve.router.dispatch.policies.disagg import DisaggConfig
from pdserve.router.dispatch.policies.placement import RoundRobinPlacement
from pdserve.router.dispatch.workers.breaker import BreakerConfig, CircuitBreaker
from pdserve.router.dispatch.workers.pool import WorkerPool

EJECTIONS = "pdserve:worker_ejections_total"


def test_threshold_failures_open_it_and_the_back_off_doubles_to_its_cap() -> None:
    clock = Clock()
    breaker = CircuitBreaker(BreakerConfig(threshold=3, base_backoff_s=1, max_backoff_s=3),
                             clock)
    assert [breaker.on_failure("INTERNAL") for _ in range(3)] == [False, False, True]
    assert breaker.is_open() and breaker.open_for_s == 1
    assert not breaker.on_failure("UNAVAILABLE")  # already open: a late failure adds nothing
    clock.now += 1.0
    assert not breaker.is_open()  # half-open: placeable on trial
    assert breaker.on_failure("INTERNAL") and breaker.open_for_s == 2  # one failure reopens
    clock.now += 2.0
    assert breaker.on_failure("INTERNAL") and breaker.open_for_s == 3  # capped
    clock.now += 3.0
    breaker.on_success()
    assert not breaker.is_open() and breaker.num_failures == 0
    assert [breaker.on_failure("INTERNAL") for _ in range(3)][-1] and breaker.open_for_s == 1


@pytest.mark.parametrize("code", ["INVALID_ARGUMENT", "CANCELLED", "DEADLINE_EXCEEDED"])
def test_failures_the_worker_did_not_cause_do_not_count(code: str) -> None:
    breaker = CircuitBreaker(BreakerConfig(threshold=1), Clock())
    assert not breaker.on_failure(code)
    assert not breaker.is_open() and breaker.num_failures == 0


async def test_a_failing_decode_worker_is_ejected_then_readmitted_after_its_back_off() -> None:
    decode = await start_fake_worker("decode", WorkerScript(fail_code=grpc.StatusCode.INTERNAL))
    clock = Clock()  # the back-off passes when the test says, however slow the machine
    pool = WorkerPool(decode=[decode.endpoint],
                      breaker=BreakerConfig(threshold=3, base_backoff_s=1.0, clock=clock))
    registry = CollectorRegistry()
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), registry, 10.0,
                              disagg=DisaggConfig(mode="never"))
    try:
        await pool.refresh_all()
        (worker,) = pool.decode
        for i in range(3):
            assert worker.snapshot().healthy  # placeable until the third failure
            with pytest.raises(WorkerFailedError):
                await collect(dispatcher.generate(f"r{i}", PROMPT, spec(2)))
        assert worker.ejected and not worker.snapshot().healthy
        assert not dispatcher.is_ready()
        assert registry.get_sample_value(EJECTIONS, {"role": "decode"}) == 1
        await pool.refresh_all()  # a passing health check does not readmit it
        assert not worker.snapshot().healthy

        clock.now += 0.75
        assert not worker.snapshot().healthy  # the back-off has not passed yet
        clock.now += 0.25
        assert worker.snapshot().healthy and not worker.ejected  # on trial
        decode.servicer.script.fail_code = None
        chunks = await collect(dispatcher.generate("r-ok", PROMPT, spec(2)))
        assert chunks[-1].finish_reason == "length"
        decode.servicer.script.fail_code = grpc.StatusCode.INTERNAL
        with pytest.raises(WorkerFailedError):  # closed again: one failure is not enough
            await collect(dispatcher.generate("r-one", PROMPT, spec(2)))
        assert worker.snapshot().healthy
        assert registry.get_sample_value(EJECTIONS, {"role": "decode"}) == 1
    finally:
        await pool.close()
        await decode.stop()


async def test_invalid_requests_never_eject_a_worker() -> None:
    decode = await start_fake_worker(
        "decode", WorkerScript(fail_code=grpc.StatusCode.INVALID_ARGUMENT))
    pool = WorkerPool(decode=[decode.endpoint], breaker=BreakerConfig(threshold=2))
    dispatcher = PDDispatcher(pool, RoundRobinPlacement(), CollectorRegistry(), 10.0,
                              disagg=DisaggConfig(mode="never"))
    try:
        await pool.refresh_all()
        for i in range(4):
            with pytest.raises(RequestRejectedError):  # the request's fault: HTTP 400
                await collect(dispatcher.generate(f"r{i}", PROMPT, spec(2)))
        assert pool.decode[0].snapshot().healthy and not pool.decode[0].ejected
    finally:
        await pool.close()
        await decode.stop()
