"""LoRA without vLLM: the worker host runs a request's adapter (vLLM's id and folder in
the engine call, the cache salt joined to the adapter), refuses one it does not serve,
refits an adapter under a fresh id; the router replays its loads on a worker that joins
later, places an adapter's requests only where it is served, and answers an unknown
``model`` 404."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import pytest

from pdserve.core.lora import LoraAdapter, LoraConfig, adapter_salt, parse_lora_module
from pdserve.core.types import PhaseRequest, SamplingSpec, WeightsStaged, WorkerHealth
from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.router.dispatch.workers.loras import LoraTargets
from pdserve.router.dispatch.workers.state import WorkerState
from pdserve.router.http.errors import ModelNotFoundError
from pdserve.router.http.openai.preprocess import Preprocessor
from pdserve.router.http.openai.schemas import CompletionRequest
from pdserve.worker.backend import WorkerError
from pdserve.worker.engine import Engine, EngineConfig, EngineParams, EngineStep
from pdserve.worker.host import EngineHost
from pdserve.worker.lora.adapters import LoadedLora

SQL = LoraAdapter("sql", "/adapters/sql")


@dataclass
class LoraEngine:
    """Records each call's params and the adapters added and removed."""

    calls: list[tuple[SamplingSpec, EngineParams]] = field(default_factory=list)
    added: list[LoadedLora] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    block_size: int = 16
    dtype: str = "float32"
    num_kv_blocks: int = 64

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSpec, params: EngineParams
                       ) -> AsyncGenerator[EngineStep, None]:
        self.calls.append((sampling, params))
        yield EngineStep((7,), finished=True, finish_reason="length")

    async def add_lora(self, lora: LoadedLora) -> None:
        if lora.adapter.path.startswith("/bad"):
            raise ValueError("not an adapter")
        self.added.append(lora)

    async def remove_lora(self, lora_id: int) -> None:
        self.removed.append(lora_id)

    async def abort(self, request_id: str) -> None: ...

    def shutdown(self) -> None: ...

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        raise NotImplementedError

    async def commit_weights(self, version: str) -> None: ...

    async def discard_weights(self) -> bool:
        return False

    async def weight_call(self, method: str, body: dict[str, object]) -> str:
        return "default"


def host(lora: LoraConfig, engine: LoraEngine) -> EngineHost:
    cfg = EngineConfig(model_path="/m", served_model_name="m", role="decode",
                       connector=ConnectorConfig(engine_id="w0"), lora=lora)
    h = EngineHost(cfg, "w0", DecodePolicy(), lambda c, n: cast(Engine, engine))
    h.start()
    return h


def request(lora_name: str | None, salt: str | None = None) -> PhaseRequest:
    return PhaseRequest("r1", "decode", (1, 2, 3), SamplingSpec(
        max_tokens=2, temperature=0.0, cache_salt=salt, lora_name=lora_name))


async def test_the_host_runs_the_adapter_under_its_salt() -> None:
    engine = LoraEngine()
    h = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    assert h.health().loras == (SQL,)
    [_ async for _ in h.generate(request("sql", salt="t1"))]
    [_ async for _ in h.generate(request(None, salt="t1"))]
    (lora_sampling, lora_params), (base_sampling, base_params) = engine.calls
    assert lora_params.lora is not None and lora_params.lora.adapter == SQL
    assert lora_sampling.cache_salt == adapter_salt("t1", SQL) != "t1"
    assert base_params.lora is None and base_sampling.cache_salt == "t1"
    with pytest.raises(WorkerError) as refused:
        [_ async for _ in h.generate(request("chat"))]
    assert refused.value.kind == "invalid_argument"


async def test_the_host_refuses_another_folder_under_the_name_as_not_here() -> None:
    """A request for sql from /adapters/sql-2 on a worker serving /adapters/sql: ABORTED
    (run it elsewhere), never run on the other folder's weights."""
    engine = LoraEngine()
    h = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    exact = request("sql")
    exact = replace(exact, sampling=replace(exact.sampling, lora_path=SQL.path))
    [_ async for _ in h.generate(exact)]
    other = replace(exact, sampling=replace(exact.sampling, lora_path="/adapters/sql-2"))
    with pytest.raises(WorkerError) as refused:
        [_ async for _ in h.generate(other)]
    assert refused.value.kind == "aborted" and len(engine.calls) == 1


async def test_load_refit_and_unload() -> None:
    engine = LoraEngine()
    h = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    first_id = h.loras.request(request("sql"))[1].lora_id  # type: ignore[union-attr]
    assert not await h.load_lora(SQL)  # served from that folder already
    refit = LoraAdapter("sql", "/adapters/sql-2")
    assert await h.load_lora(refit)
    assert engine.added[-1].adapter == refit and engine.added[-1].lora_id != first_id
    assert engine.removed == [first_id]
    assert h.health().loras == (refit,)
    with pytest.raises(ValueError):
        await h.load_lora(LoraAdapter("x", "/bad/x"))
    assert h.health().loras == (refit,)  # a refused folder changes nothing
    assert await h.unload_lora("sql") and not await h.unload_lora("sql")
    assert h.health().loras == ()


async def test_lora_off_refuses_loads() -> None:
    h = host(LoraConfig(), LoraEngine())
    with pytest.raises(WorkerError) as off:
        await h.load_lora(SQL)
    assert off.value.kind == "failed_precondition"


def test_lora_module_forms() -> None:
    assert parse_lora_module("sql=/adapters/sql") == SQL
    assert parse_lora_module('{"name": "sql", "path": "/adapters/sql", '
                             '"base_model_name": "m"}') == SQL
    for bad in ("sql", "=/p", '{"name": 1}'):
        with pytest.raises(ValueError):
            parse_lora_module(bad)
    with pytest.raises(ValueError):
        LoraConfig(modules=(SQL,))  # needs --enable-lora
    with pytest.raises(ValueError):
        LoraConfig(enable_lora=True, max_lora_rank=7)


@dataclass
class Calls:
    loaded: list[LoraAdapter] = field(default_factory=list)
    unloaded: list[str] = field(default_factory=list)
    fail: bool = False

    async def load_lora(self, adapter: LoraAdapter, timeout_s: float) -> bool:
        if self.fail:
            raise RuntimeError("UNAVAILABLE")
        self.loaded.append(adapter)
        return True

    async def unload_lora(self, name: str, timeout_s: float) -> bool:
        self.unloaded.append(name)
        return True


async def test_the_router_replays_its_loads_on_a_joining_worker() -> None:
    targets = LoraTargets()
    targets.on_loaded(SQL)
    targets.on_unloaded("old")
    joining = WorkerHealth(ready=True, role="decode", worker_id="d1",
                           loras=(LoraAdapter("old", "/a/old"),))
    assert targets.needs_replay(joining)
    calls = Calls()
    result = await targets.replay(calls, joining)
    assert calls.loaded == [SQL] and calls.unloaded == ["old"]
    assert result.changed and not result.lora_off
    assert not targets.needs_replay(replace(joining, loras=(SQL,)))  # nothing left to do
    loading = WorkerHealth(ready=False, role="decode", worker_id="d2")
    assert not targets.needs_replay(loading)  # not before it is ready
    failing = await targets.replay(Calls(fail=True), replace(joining, loras=()))
    assert not failing.changed  # not placed for it; tried again after the next check


def test_placement_reads_what_a_worker_serves() -> None:
    state = WorkerState(endpoint="e", role="decode", healthy=True, loras=(SQL,))
    assert state.serves(None) and state.serves("sql") and not state.serves("chat")
    assert not WorkerState(endpoint="e", role="decode").serves("sql")


def test_a_model_names_the_base_model_or_an_adapter(tokenizer: Any) -> None:
    """As on ``vllm serve``: an adapter's name runs it (the response names it), the base
    model's runs none, anything else is 404 ``model_not_found``."""

    class Served:
        def adapter(self, name: str | None) -> LoraAdapter | None:
            return SQL if name == "sql" else None

    pre = Preprocessor(served_model_name="m", max_model_len=4096, tokenizer=tokenizer,
                       loras=Served())
    lora = pre.completion(CompletionRequest(model="sql", prompt="hi", max_tokens=2))
    assert (lora.model, lora.sampling.lora_name) == ("sql", "sql")
    assert lora.sampling.lora_path == SQL.path  # its exact identity rides with it
    base = pre.completion(CompletionRequest(model="m", prompt="hi", max_tokens=2))
    assert (base.model, base.sampling.lora_name) == ("m", None)
    with pytest.raises(ModelNotFoundError) as missing:
        pre.completion(CompletionRequest(model="chat", prompt="hi", max_tokens=2))
    assert missing.value.status_code == 404


def test_up_hands_its_lora_flags_to_the_workers_unchanged() -> None:
    """``pdserve up`` hands its LoRA flags to each vLLM worker as it parsed them
    (``configs.worker_flags``): parsed there as the worker's own, the same config."""
    from pdserve.cli.configs import lora_config, worker_flags
    from pdserve.cli.parser import build_parser

    cfg = LoraConfig(enable_lora=True, modules=(SQL, LoraAdapter("chat", "/a/chat")),
                     max_loras=2, max_lora_rank=8)
    up = build_parser().parse_args(
        ["up", "--enable-lora", "--lora-modules", "sql=/adapters/sql",
         "--lora-modules", "chat=/a/chat", "--max-loras", "2", "--max-lora-rank", "8"])
    assert lora_config(up) == cfg
    worker = build_parser().parse_args(["decode", *worker_flags(up)])
    assert lora_config(worker) == cfg
    plain = build_parser().parse_args(["decode", *worker_flags(build_parser().parse_args(
        ["up"]))])
    assert lora_config(plain) == LoraConfig()
    # vllm serve's form: several after one --lora-modules.
    several = build_parser().parse_args(
        ["decode", "--enable-lora", "--lora-modules", "sql=/adapters/sql", "chat=/a/chat"])
    assert lora_config(several).modules == cfg.modules


@pytest.mark.parametrize("adapter", [SQL, LoraAdapter("a=b", "/x"), LoraAdapter("{x", "/y"),
                                     LoraAdapter(" pad", "/p "), LoraAdapter("n", "/a=b")])
def test_an_adapter_reads_back_from_its_entry(adapter: LoraAdapter) -> None:
    assert parse_lora_module(str(adapter)) == adapter


def test_up_refuses_lora_on_simulated_workers() -> None:
    from pdserve.cli.configs import worker_flags
    from pdserve.cli.parser import build_parser

    args = build_parser().parse_args(["up", "--simulated", "--enable-lora"])
    with pytest.raises(ValueError, match="simulated workers serve no adapters"):
        worker_flags(args)


async def test_a_bad_module_folder_fails_the_start() -> None:
    """As ``vllm serve``: the adapters it starts with are loaded before it serves."""
    engine = LoraEngine()
    good = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    await good.start_loras()
    assert [loaded.adapter for loaded in engine.added] == [SQL]
    bad = host(LoraConfig(enable_lora=True, modules=(LoraAdapter("x", "/bad/x"),)),
               LoraEngine())
    with pytest.raises(ValueError, match="not an adapter"):
        await bad.start_loras()


def test_names_that_would_break_cache_keys_are_refused() -> None:
    for name in ("a@b", "a#b", "x@lora:y"):
        with pytest.raises(ValueError, match="may not hold"):
            LoraAdapter(name, "/a")
    with pytest.raises(ValueError, match="served model's name"):
        EngineConfig(model_path="/m", served_model_name="m", role="decode",
                     connector=ConnectorConfig(engine_id="w0"),
                     lora=LoraConfig(enable_lora=True, modules=(LoraAdapter("m", "/a"),)))


async def test_loads_on_one_host_run_one_at_a_time() -> None:
    """Two loads of the same folder that cross add it to the engine once."""

    class Slow(LoraEngine):
        async def add_lora(self, lora: LoadedLora) -> None:
            await asyncio.sleep(0.01)
            await super().add_lora(lora)

    engine = Slow()
    h = host(LoraConfig(enable_lora=True), engine)
    results = await asyncio.gather(h.load_lora(SQL), h.load_lora(SQL))
    assert sorted(results) == [False, True]
    assert len(engine.added) == 1 and engine.removed == []


class Blocking(LoraEngine):
    """Its requests run until ``release`` is set (or they are aborted)."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()
        self.running = asyncio.Event()
        self.aborted: list[str] = []

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSpec, params: EngineParams
                       ) -> AsyncGenerator[EngineStep, None]:
        self.calls.append((sampling, params))
        self.running.set()
        await self.release.wait()
        yield EngineStep((7,), finished=True,
                         finish_reason="abort" if self.aborted else "length")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.release.set()


async def run_one(h: EngineHost, req: PhaseRequest) -> list[str | None]:
    return [out.finish_reason async for out in h.generate(req)]


async def test_an_unload_lets_running_requests_finish_first() -> None:
    engine = Blocking()
    h = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    running = asyncio.create_task(run_one(h, request("sql")))
    await asyncio.wait_for(engine.running.wait(), 2)
    unloading = asyncio.create_task(h.unload_lora("sql"))
    await asyncio.sleep(0.1)
    assert not unloading.done() and engine.removed == []  # waits for the running one
    with pytest.raises(WorkerError):  # new ones are refused meanwhile
        await run_one(h, request("sql"))
    engine.release.set()
    assert await asyncio.wait_for(running, 2) == ["length"]  # whole, not cut short
    assert await asyncio.wait_for(unloading, 2) is True
    assert engine.removed == [1] and engine.aborted == []


async def test_a_refit_drains_the_old_adapter_and_aborts_past_its_deadline() -> None:
    engine = Blocking()
    h = host(LoraConfig(enable_lora=True, modules=(SQL,)), engine)
    h.lora.drain_s = 0.1
    running = asyncio.create_task(run_one(h, request("sql")))
    await asyncio.wait_for(engine.running.wait(), 2)
    assert await asyncio.wait_for(h.load_lora(LoraAdapter("sql", "/adapters/sql-2")), 2)
    assert await asyncio.wait_for(running, 2) == ["abort"]  # the router continues it
    assert len(engine.aborted) == 1 and engine.removed == [1]
