"""``EngineHost`` with a fake engine (no vLLM): each role's policy (what the engine
is asked for), KV-handle leases on prefill (held when a request finishes,
released over the control endpoint on abort, pruned when expired), and the
abort of in-flight requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from pdserve.core.handle import KVHandle, PushTarget
from pdserve.core.types import PhaseOutput, PhaseRequest, Role, SamplingSpec, WeightsStaged
from pdserve.core.weight_calls import (
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    TransferInitInfo,
    TransferUpdateInfo,
    UpdateWeights,
    UpdateWeightVersion,
    WeightCall,
    version_set_by,
)
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.worker.backend import WorkerError
from pdserve.worker.engine import EngineConfig, EngineCounters, EngineParams, EngineStep
from pdserve.worker.host import EngineHost
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.lora.adapters import LoadedLora
from pdserve.worker.policy import RolePolicy

PROMPT = (11, 12, 13, 14)
TARGET = PushTarget("10.0.0.2", 6001, "t-1")


def handle(rid: str = "r1", deadline_ns: int | None = None) -> KVHandle:
    if deadline_ns is None:
        deadline_ns = time.time_ns() + 30 * 10**9
    return KVHandle(engine_id="p0", remote_request_id=f"{rid}-internal", block_ids=(3, 4),
                    num_tokens=len(PROMPT), transport="tcp", host="127.0.0.1", port=7001,
                    transfer_id=f"x-{rid}", lease_deadline_unix_ns=deadline_ns)


@dataclass
class FakeEngine:
    """An ``Engine`` that plays ``steps`` for every request (after ``gate``, if set)
    and records what the host asked of it. An aborted request ends as vLLM ends
    it: one last output, finished with reason ``abort``."""

    steps: Sequence[EngineStep] = ()
    gate: asyncio.Event | None = None
    calls: list[tuple[str, tuple[int, ...], SamplingSpec, EngineParams]] = field(
        default_factory=list)
    aborted: list[str] = field(default_factory=list)
    closed_early: list[str] = field(default_factory=list)
    is_shut_down: bool = False
    block_size: int = 128
    dtype: str = "float32"
    num_kv_blocks: int = 64
    staged: str | None = None
    committed: list[str] = field(default_factory=list)
    mirror: KvCacheMirror | None = None  # its KV events' mirror (None: it publishes none)
    num_mirrorings: int = 0
    status: dict[str, Any] = field(default_factory=dict)  # its connector's counters

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSpec, params: EngineParams
                       ) -> AsyncGenerator[EngineStep, None]:
        self.calls.append((request_id, tuple(prompt_token_ids), sampling, params))
        done = False
        try:
            if self.gate is not None:
                await self.gate.wait()
            if request_id in self.aborted:
                yield EngineStep((), finished=True, finish_reason="abort")
            else:
                for step in self.steps:
                    yield step
            done = True
        finally:
            if not done:
                self.closed_early.append(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        if self.gate is not None:
            self.gate.set()

    def shutdown(self) -> None:
        self.is_shut_down = True

    def mirror_kv_events(self, loop: asyncio.AbstractEventLoop) -> KvCacheMirror | None:
        self.num_mirrorings += 1
        return self.mirror

    def kv_status(self) -> dict[str, Any]:
        return self.status

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        if model_path.startswith("/bad"):
            raise ValueError(f"{model_path}: not the served model's layout")
        self.staged = version
        return WeightsStaged(num_tensors=1, num_bytes=4)

    async def commit_weights(self, version: str) -> None:
        self.committed.append(version)

    async def discard_weights(self) -> bool:
        had, self.staged = self.staged is not None, None
        return had

    async def weight_call(self, call: WeightCall) -> str:
        return version_set_by(call) or "default"

    async def add_lora(self, lora: LoadedLora) -> None:
        raise NotImplementedError("FakeEngine serves no LoRA adapters")

    async def remove_lora(self, lora_id: int) -> None:
        raise NotImplementedError("FakeEngine serves no LoRA adapters")


@dataclass
class Released:
    handles: list[KVHandle] = field(default_factory=list)

    def __call__(self, h: KVHandle) -> None:
        self.handles.append(h)


def config(role: Role) -> EngineConfig:
    return EngineConfig(model_path="/m", served_model_name="m", role=role,
                        connector=ConnectorConfig(engine_id="w0"), dtype="float32")


def started(role: Role, policy: RolePolicy, engine: FakeEngine) -> EngineHost:
    def factory(cfg: EngineConfig, counters: EngineCounters) -> FakeEngine:
        return engine

    host = EngineHost(config(role), "w0", policy, factory)
    host.start()
    return host


def request(phase: Role, max_tokens: int = 8, kv_handle: KVHandle | None = None,
            push: PushTarget | None = None, rid: str = "r1") -> PhaseRequest:
    return PhaseRequest(rid, phase, PROMPT, SamplingSpec(max_tokens=max_tokens, temperature=0.0),
                        kv_handle=kv_handle, push_target=push)


async def run(host: EngineHost, req: PhaseRequest) -> list[PhaseOutput]:
    return [out async for out in host.generate(req)]


# ---- what each role asks of the engine --------------------------------------------------


@pytest.mark.parametrize(("max_tokens", "push", "kv_push", "params"), [
    (1, None, False, None),  # no decode follows: nothing held
    (1, TARGET, True, None),
    (8, None, True, {"do_remote_decode": True}),
    (8, TARGET, False, {"do_remote_decode": True}),  # push off on this worker
    (8, TARGET, True, {"do_remote_decode": True, "push": TARGET.to_params()}),
])
def test_prefill_computes_one_token_and_holds_kv_only_for_a_decode(
        max_tokens: int, push: PushTarget | None, kv_push: bool,
        params: dict[str, object] | None) -> None:
    got = PrefillPolicy(kv_push=kv_push).engine_params(request("prefill", max_tokens, push=push))
    assert got == EngineParams(max_tokens=1, kv_transfer_params=params)


def test_decode_loads_from_the_handle_or_computes_alone() -> None:
    h = handle()
    got = DecodePolicy().engine_params(request("decode", 5, kv_handle=h))
    assert got == EngineParams(5, dict(h.to_params(), do_remote_prefill=True))
    assert DecodePolicy().engine_params(request("decode", 5)) == EngineParams(5, None)


async def test_host_passes_the_policy_params_and_the_sampling_to_the_engine() -> None:
    engine = FakeEngine([EngineStep((7,), finished=True, finish_reason="length")])
    host = started("prefill", PrefillPolicy(kv_push=True), engine)
    req = request("prefill", 8, push=TARGET)
    await run(host, req)
    assert engine.calls == [("r1", PROMPT, req.sampling, EngineParams(
        1, {"do_remote_decode": True, "push": TARGET.to_params()}))]


def test_a_policy_serves_only_its_own_role() -> None:
    with pytest.raises(ValueError, match="prefill policy"):
        EngineHost(config("decode"), "w0", PrefillPolicy(), lambda c, n: FakeEngine())


# ---- outputs and leases -------------------------------------------------------------------


async def test_a_finished_prefill_returns_the_handle_and_holds_its_lease() -> None:
    h = handle()
    engine = FakeEngine([EngineStep((7,), True, "length", h.to_params(), num_cached_tokens=2)])
    policy = PrefillPolicy(release=Released())
    host = started("prefill", policy, engine)
    outs = await run(host, request("prefill", 8))
    assert [replace(o, timing=None) for o in outs] == [
        PhaseOutput((7,), "length", h, num_cached_tokens=2, num_prompt_tokens=len(PROMPT),
                    weight_version="default")]
    assert "r1" in policy.leases and len(policy.leases) == 1


async def test_the_last_output_carries_the_phase_timing() -> None:
    """The engine's queue and compute times, the worker's wall-clock stamps; a decode
    that loads KV counts its queue wait as the load, one that computes alone does not."""
    steps = [EngineStep((1,)), EngineStep((2,), True, "length", queue_ns=30, compute_ns=40)]
    before = time.time_ns()
    for kv_handle, kv_load_ns in ((handle(), 30), (None, 0)):
        outs = await run(started("decode", DecodePolicy(), FakeEngine(list(steps))),
                         request("decode", 2, kv_handle=kv_handle))
        assert outs[0].timing is None
        timing = outs[-1].timing
        assert timing is not None
        assert (timing.queue_ns, timing.compute_ns, timing.kv_load_ns) == (30, 40, kv_load_ns)
        assert before <= timing.admitted_unix_ns <= timing.first_token_unix_ns <= time.time_ns()


async def test_no_lease_without_a_decode_to_follow() -> None:
    engine = FakeEngine([EngineStep((7,), True, "length", handle().to_params())])
    policy = PrefillPolicy()
    outs = await run(started("prefill", policy, engine), request("prefill", 1))
    assert outs[-1].kv_handle is None and len(policy.leases) == 0


async def test_decode_streams_deltas_and_maps_the_finish_reason() -> None:
    engine = FakeEngine([EngineStep((1,)), EngineStep((2, 3)),
                         EngineStep((4,), True, "weird", {"x": 1})])
    outs = await run(started("decode", DecodePolicy(), engine), request("decode", 4))
    assert [(o.token_ids, o.finish_reason, o.kv_handle) for o in outs] == [
        ((1,), None, None), ((2, 3), None, None), ((4,), "error", None)]


async def test_abort_releases_the_lease_over_the_control_endpoint_once() -> None:
    h = handle()
    released = Released()
    policy = PrefillPolicy(release=released)
    engine = FakeEngine([EngineStep((7,), True, "length", h.to_params())])
    host = started("prefill", policy, engine)
    await run(host, request("prefill", 8))
    assert await host.abort("r1") is True
    assert released.handles == [h] and len(policy.leases) == 0
    assert engine.aborted == []  # finished: nothing for the engine to stop
    assert await host.abort("r1") is False  # nothing left to free
    assert released.handles == [h]


async def test_prune_forgets_expired_leases_only() -> None:
    policy = PrefillPolicy(release=Released())
    now = time.time_ns()
    policy.leases.hold("old", handle("old", now - 1))
    policy.leases.hold("new", handle("new", now + 10**9))
    policy.prune(now)
    assert "old" not in policy.leases and "new" in policy.leases


async def test_load_prunes_leases_and_reports_the_counters() -> None:
    policy = PrefillPolicy(release=Released())
    host = EngineHost(config("prefill"), "w0", policy, lambda c, n: FakeEngine())
    policy.leases.hold("old", handle("old", 1))
    host.counters.prompt_tokens_computed = 5
    load = await host.load()  # not started: no connector to ask
    assert len(policy.leases) == 0
    assert (load.prompt_tokens_computed, load.num_inflight_reqs) == (5, 0)


# ---- abort of in-flight requests ----------------------------------------------------------


async def test_abort_stops_an_inflight_request_in_the_engine() -> None:
    engine = FakeEngine([EngineStep((1,), True, "stop")], gate=asyncio.Event())
    host = started("decode", DecodePolicy(), engine)
    consumer = asyncio.ensure_future(run(host, request("decode", 4)))
    while host.num_inflight == 0:
        await asyncio.sleep(0)
    assert await host.abort("r1") is True
    assert engine.aborted == ["r1"]
    outs = await consumer
    assert [(o.token_ids, o.finish_reason) for o in outs] == [((), "abort")]
    assert host.num_inflight == 0 and engine.closed_early == []
    assert await host.abort("r1") is False


async def test_closing_the_outputs_early_closes_the_engine_stream() -> None:
    engine = FakeEngine([EngineStep((1,)), EngineStep((2,)), EngineStep((3,), True, "length")])
    host = started("decode", DecodePolicy(), engine)
    outs = host.generate(request("decode", 3))
    assert (await anext(outs)).token_ids == (1,)
    await outs.aclose()
    assert engine.closed_early == ["r1"] and host.num_inflight == 0


# ---- lifecycle, health, KV-event mirror ---------------------------------------------------


async def test_health_before_and_after_the_engine_starts() -> None:
    engine = FakeEngine(dtype="bfloat16")
    host = EngineHost(config("decode"), "w0", DecodePolicy(), lambda c, n: engine)
    before = host.health()
    assert (before.ready, before.role, before.block_size) == (False, "decode", 0)
    with pytest.raises(WorkerError, match="loading"):
        await run(host, request("decode"))
    host.start()
    after = host.health()
    assert (after.ready, after.dtype, after.block_size) == (True, "bfloat16", 128)
    assert after.compatibility_hash != before.compatibility_hash
    assert host.health() is after  # built once while the engine runs
    host.shutdown()
    assert engine.is_shut_down and not host.ready
    assert not host.health().ready


@pytest.mark.parametrize("role", ["prefill", "decode"])
async def test_every_role_mirrors_its_engines_kv_events_across_a_role_switch(
        role: Role) -> None:
    engine = FakeEngine(mirror=KvCacheMirror(128))
    policies: dict[Role, RolePolicy] = {"prefill": PrefillPolicy(), "decode": DecodePolicy()}
    host = EngineHost(config(role), "w0", policies[role], lambda c, n: engine,
                      policy_for=policies.__getitem__)
    with pytest.raises(WorkerError) as err:  # no engine, no mirror yet
        host.kv_mirror()
    assert err.value.kind == "unavailable"
    host.start()
    host.start_mirroring(asyncio.get_running_loop())
    host.start_mirroring(asyncio.get_running_loop())  # once per engine
    try:
        assert host.kv_mirror() is engine.mirror
        host.set_role("decode" if role == "prefill" else "prefill")
        assert host.kv_mirror() is engine.mirror  # same engine, same prefix cache
        assert engine.num_mirrorings == 1
    finally:
        host.shutdown()
    assert engine.is_shut_down  # its mirroring with it
    silent = EngineHost(config(role), "w1", policies[role], lambda c, n: FakeEngine())
    silent.start()
    silent.start_mirroring(asyncio.get_running_loop())
    assert silent.kv_mirror() is None  # an engine that publishes no events


async def test_the_load_report_carries_the_engines_connector_counters() -> None:
    engine = FakeEngine(status={"num_leases": 2, "bytes_sent": 4096, "step_base_us": 900})
    host = started("prefill", PrefillPolicy(), engine)
    report = await host.load()
    assert (report.kv_leases_held, report.num_pending_transfers, report.kv_bytes_sent,
            report.step_base_us) == (2, 2, 4096, 900)


# ---- a role switch ------------------------------------------------------------------------


async def test_a_role_switch_keeps_the_engine_and_hands_the_requests_to_the_new_policy(
        ) -> None:
    held = handle("r1")
    engine = FakeEngine(steps=[EngineStep((7,), finished=True, finish_reason="length",
                                          kv_transfer_params=held.to_params())])
    released = Released()
    policies: dict[Role, RolePolicy] = {"prefill": PrefillPolicy(release=released),
                                        "decode": DecodePolicy()}
    host = EngineHost(config("prefill"), "w0", policies["prefill"], lambda c, n: engine,
                      policy_for=policies.__getitem__)
    host.start()
    host.start_mirroring(asyncio.get_running_loop())
    (out,) = await run(host, request("prefill"))
    assert out.kv_handle is not None
    # The drain ran out: the lease still held is released.
    assert (await host.end_role_work())[0] == 0 and released.handles == [held]
    host.set_role("decode")
    assert (host.health().role, host.config.role, host.policy) == ("decode", "decode",
                                                                   policies["decode"])
    assert host.engine is engine and not engine.is_shut_down  # no reload
    await run(host, request("decode", kv_handle=handle("r2")))
    assert engine.calls[-1][3].kv_transfer_params["do_remote_prefill"] is True  # type: ignore[index]
    host.set_role("decode")  # the same role: nothing happens
    assert host.policy is policies["decode"]


async def test_a_role_switch_needs_a_policy_factory_and_nothing_in_flight() -> None:
    fixed = started("decode", DecodePolicy(), FakeEngine())
    with pytest.raises(WorkerError) as err:
        fixed.set_role("prefill")
    assert err.value.kind == "unimplemented"
    gate = asyncio.Event()
    engine = FakeEngine(steps=[EngineStep((1,), finished=True, finish_reason="length")],
                        gate=gate)
    host = EngineHost(config("decode"), "w0", DecodePolicy(), lambda c, n: engine,
                      policy_for=lambda role: PrefillPolicy() if role == "prefill"
                      else DecodePolicy())
    host.start()
    stream = asyncio.create_task(run(host, request("decode")))
    await asyncio.sleep(0)
    with pytest.raises(WorkerError) as busy:
        host.set_role("prefill")
    assert busy.value.kind == "failed_precondition"
    assert await host.end_role_work() == (1, 0)  # aborted: the stream ends ``abort``
    assert (await stream)[-1].finish_reason == "abort"
    host.set_role("prefill")
    assert host.health().role == "prefill"


@pytest.mark.parametrize("call", [
    InitWeightTransferEngine(TransferInitInfo(master_address="127.0.0.1", master_port=1,
                                              rank_offset=1, world_size=2)),
    StartWeightUpdate(), UpdateWeights(TransferUpdateInfo()), FinishWeightUpdate(),
    ShutdownWeightTransferEngine()], ids=lambda call: call.name)
async def test_a_weight_transfer_call_without_a_backend_is_refused_before_the_engine(
        call: WeightCall) -> None:
    """Found by the socket fuzz on vLLM: the engine failed deep inside (a 500 at the
    router); a call the worker was not started for is the caller's mistake."""
    host = EngineHost(config("decode"), "w0", DecodePolicy(), lambda c, n: FakeEngine())
    host.start()
    with pytest.raises(WorkerError, match="weight transfer is off") as caught:
        await host.engine_weight_call(call)
    assert caught.value.kind == "failed_precondition"
    assert await host.engine_weight_call(UpdateWeightVersion("v3")) == "v3"
    on = EngineHost(replace(config("decode"), weight_transfer_backend="nccl"), "w0",
                    DecodePolicy(), lambda c, n: FakeEngine())
    on.start()
    assert await on.engine_weight_call(call) == "default"
    host.shutdown()
    on.shutdown()
