"""Prefill in order (``roles/prefill/admission.py``): at most ``max_running`` prompts in
the engine, the rest waiting in ``fifo`` or ``shortest`` order (a long one not starved
past ``max_wait_s``), waits that end with their request; and through ``EngineHost`` with
a fake engine: the second prompt enters the engine only when the first left it, its wait
is in its timing's queue time and in the load's waiting count, and a worker switched to
prefill at run time gets the gate (one switched to decode does not)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from unit.test_engine_host import FakeEngine, config, request, run

from pdserve.core.types import PhaseRequest, Role, SamplingSpec
from pdserve.launch.serve_worker import role_policy
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.roles.prefill.admission import AdmissionConfig, PrefillAdmission
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.worker.engine import EngineStep
from pdserve.worker.host import EngineHost
from pdserve.worker.policy import RolePolicy


class Entered:
    """Prompts that go into the gate as tasks, and the order they got through it."""

    def __init__(self, gate: PrefillAdmission) -> None:
        self.gate = gate
        self.order: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def _hold(self, name: str, num_tokens: int) -> None:
        async with self.gate.admitted(num_tokens):
            self.order.append(name)
            await self.release[name].wait()

    async def add(self, name: str, num_tokens: int = 10) -> None:
        self.release[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(self._hold(name, num_tokens))
        await asyncio.sleep(0)

    async def finish(self, name: str) -> None:
        self.release[name].set()
        await self.tasks[name]
        for _ in range(3):
            await asyncio.sleep(0)


async def test_fifo_admits_in_arrival_order_at_most_max_running() -> None:
    entered = Entered(PrefillAdmission(AdmissionConfig(max_running=2, order="fifo")))
    for name in "abcd":
        await entered.add(name)
    assert entered.order == ["a", "b"]
    assert (entered.gate.num_running, entered.gate.num_waiting) == (2, 2)
    await entered.finish("b")
    assert entered.order == ["a", "b", "c"]
    await entered.finish("a")
    assert entered.order == ["a", "b", "c", "d"]
    for name in "cd":
        await entered.finish(name)
    assert (entered.gate.num_running, entered.gate.num_waiting) == (0, 0)


async def test_shortest_goes_first_and_no_prompt_waits_past_max_wait() -> None:
    now = [0.0]
    entered = Entered(PrefillAdmission(
        AdmissionConfig(max_running=1, order="shortest", max_wait_s=5.0), lambda: now[0]))
    await entered.add("running", 50)
    await entered.add("long", 900)
    now[0] = 1.0
    await entered.add("short", 20)
    await entered.add("shorter", 10)
    await entered.finish("running")
    assert entered.order == ["running", "shorter"]
    now[0] = 6.0  # "long" has waited 6 s: past max_wait_s, it goes before "short"
    await entered.finish("shorter")
    assert entered.order == ["running", "shorter", "long"]
    await entered.finish("long")
    await entered.finish("short")
    assert entered.order == ["running", "shorter", "long", "short"]


async def test_a_cancelled_wait_leaves_the_queue_and_a_cancelled_grant_passes_on() -> None:
    gate = PrefillAdmission(AdmissionConfig(max_running=1))
    entered = Entered(gate)
    running = gate.admitted(10)
    await running.__aenter__()  # "a" is in the engine
    for name in "bcd":
        await entered.add(name)
    entered.tasks["b"].cancel()  # waiting: it leaves the queue
    await asyncio.sleep(0)
    assert gate.num_waiting == 2
    await running.__aexit__(None, None, None)  # "a" leaves: "c" is let in ...
    entered.tasks["c"].cancel()  # ... and cancelled before it ran: its place passes on
    for _ in range(3):
        await asyncio.sleep(0)
    assert entered.order == ["d"]
    await entered.finish("d")
    assert (gate.num_running, gate.num_waiting) == (0, 0)
    for name in "bc":
        assert entered.tasks[name].cancelled()


async def test_no_limit_admits_everything_at_once() -> None:
    entered = Entered(PrefillAdmission(AdmissionConfig()))
    for name in "abc":
        await entered.add(name)
    assert entered.order == ["a", "b", "c"] and entered.gate.num_waiting == 0
    for name in "abc":
        await entered.finish(name)


@pytest.mark.parametrize(("fields", "match"), [
    ({"max_running": -1}, "max_running"), ({"order": "lifo"}, "order"),
    ({"max_wait_s": 0}, "max_wait_s")])
def test_bad_admission_settings_are_refused(fields: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AdmissionConfig(**fields)  # type: ignore[arg-type]


# ---- through the engine host ----------------------------------------------------------


def _prompt(rid: str, length: int) -> PhaseRequest:
    return PhaseRequest(rid, "prefill", tuple(range(10, 10 + length)),
                        SamplingSpec(max_tokens=1, temperature=0.0))


def _gated_host() -> tuple[EngineHost, FakeEngine, PrefillPolicy, asyncio.Event]:
    """A started prefill host, one prompt in its engine at a time, whose engine holds
    every prompt until the returned event is set."""
    gate = asyncio.Event()
    engine = FakeEngine(steps=[EngineStep((7,), finished=True, finish_reason="length")],
                        gate=gate)
    policy = PrefillPolicy(admission=AdmissionConfig(max_running=1))
    host = EngineHost(config("prefill"), "w0", policy, lambda c, n: engine)
    host.start()
    return host, engine, policy, gate


async def test_the_host_lets_a_prompt_in_only_when_the_one_before_left() -> None:
    host, engine, policy, gate = _gated_host()
    first = asyncio.create_task(run(host, _prompt("r1", 40)))
    second = asyncio.create_task(run(host, _prompt("r2", 8)))
    await asyncio.sleep(0.05)
    assert [c[0] for c in engine.calls] == ["r1"]  # r2 waits in front of the engine
    assert host.num_inflight == 2 and (await host.load()).num_waiting_reqs == 1
    gate.set()
    (out1,), (out2,) = await first, await second
    assert [c[0] for c in engine.calls] == ["r1", "r2"]
    assert out2.timing is not None and out2.timing.queue_ns >= 40_000_000  # its wait
    assert out1.timing is not None and out1.timing.queue_ns < out2.timing.queue_ns


@pytest.mark.parametrize("start", ["decode", "prefill"])
async def test_a_role_switch_carries_the_admission_of_the_role(start: Role) -> None:
    cfg = replace(config(start), prefill_max_running=1, prefill_order="shortest")
    policies: dict[Role, RolePolicy] = {r: role_policy(cfg, False, r)
                                        for r in ("prefill", "decode")}
    engine = FakeEngine(steps=[EngineStep((7,), finished=True, finish_reason="length")])
    host = EngineHost(cfg, "w0", policies[start], lambda c, n: engine,
                      policy_for=policies.__getitem__)
    host.start()
    host.set_role("prefill")
    assert isinstance(host.policy, PrefillPolicy)
    assert host.policy.admission.config == AdmissionConfig(1, "shortest")
    (out,) = await run(host, request("prefill", max_tokens=1))
    assert out.finish_reason == "length"
    host.set_role("decode")
    assert isinstance(host.policy, DecodePolicy) and host.policy.num_waiting == 0
    async with host.policy.admitted(request("decode")) as waited:
        assert waited == 0.0  # decode: every request enters at once


async def test_a_prompt_aborted_while_it_waits_never_enters_the_engine() -> None:
    """The router's abort, or a role switch's drain with a backlog: the waiting prompt
    ends ``abort`` at once (as an engine abort ends one), the running one is aborted in
    the engine, and nothing enters the engine after the drain."""
    host, engine, policy, gate = _gated_host()
    tasks = [asyncio.create_task(run(host, _prompt(f"r{i}", 8))) for i in range(3)]
    await asyncio.sleep(0.02)
    assert [c[0] for c in engine.calls] == ["r0"] and policy.num_waiting == 2

    assert await host.abort("r2")  # waiting: it ends now, without the engine
    (out2,) = await tasks[2]
    assert out2.finish_reason == "abort" and engine.aborted == []
    aborted, _ = await host.end_role_work()  # r0 running, r1 waiting
    outs = [await t for t in tasks[:2]]
    assert aborted == 2 and [o[-1].finish_reason for o in outs] == ["abort", "abort"]
    assert [c[0] for c in engine.calls] == ["r0"] and engine.aborted == ["r0"]
    assert host.num_inflight == 0 and policy.admission.num_running == 0
