"""The simulated worker's weights (``EngineHost`` over a ``SimEngine``): staged from a
folder, committed only as the staged version, named on each call's first output and on
its KV handles, and visible in the tokens (so a test can tell which version wrote a text)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from unit.sim_cluster import start_sim_worker

from pdserve.cli.configs import sim_config, up_config
from pdserve.cli.parser import build_parser
from pdserve.core.handle import KVHandle
from pdserve.core.model import ResolvedModel
from pdserve.core.types import PhaseOutput, PhaseRequest, Role, SamplingSpec
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
)
from pdserve.launch.sim_worker import sim_host as start_host
from pdserve.launch.up import plan
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.pdserve.v1 import worker_pb2_grpc as pb_grpc
from pdserve.router.dispatch.workers.client import WorkerCallError, WorkerClient
from pdserve.worker.backend import WorkerError
from pdserve.worker.host import EngineHost
from pdserve.worker.servicer import start_worker_server
from pdserve.worker.sim.engine import SimConfig

PROMPT = (3, 1, 4, 1, 5, 9, 2, 6)


def sim_host(role: Role = "decode", stage_weights_s: float = 0.0,
             weight_version: str = "default") -> EngineHost:
    return start_host(SimConfig(
        role, f"{role}-0", prefill_s_per_token=0.0, decode_s_per_token=0.0,
        stage_weights_s=stage_weights_s, weight_version=weight_version))


async def run(host: EngineHost, prompt: tuple[int, ...], max_tokens: int = 4,
              kv_handle: KVHandle | None = None) -> list[PhaseOutput]:
    request = PhaseRequest("r-1", host.policy.role, prompt, SamplingSpec(max_tokens=max_tokens),
                           kv_handle=kv_handle)
    return [out async for out in host.generate(request)]


def tokens(outs: list[PhaseOutput]) -> list[int]:
    return [t for out in outs for t in out.token_ids]


async def update(host: EngineHost, folder: Path, version: str) -> None:
    await host.stage_weights(str(folder), version)
    await host.commit_weights(version)


async def test_staging_needs_a_folder_and_takes_the_modelled_time(tmp_path: Path) -> None:
    host = sim_host(stage_weights_s=0.02)
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        await host.stage_weights(str(tmp_path / "model.safetensors"), "v2")
    with pytest.raises(ValueError, match="not a checkpoint folder"):
        await host.stage_weights(str(tmp_path / "missing"), "v2")
    with pytest.raises(ValueError, match="weight_version"):
        await host.stage_weights(str(tmp_path), "")
    staged = await host.stage_weights(str(tmp_path), "v2")
    assert staged.num_bytes == 100 and staged.stage_ns >= 0.02e9


async def test_a_commit_needs_that_version_staged(tmp_path: Path) -> None:
    host = sim_host()
    with pytest.raises(WorkerError, match="nothing is staged") as refused:
        await host.commit_weights("v2")
    assert refused.value.kind == "failed_precondition"
    await host.stage_weights(str(tmp_path), "v2")
    with pytest.raises(WorkerError, match="version 'v2' is staged"):
        await host.commit_weights("v9")
    assert await host.discard_weights() and not await host.discard_weights()
    with pytest.raises(WorkerError, match="nothing is staged"):
        await host.commit_weights("v2")
    assert host.health().weight_version == "default"


async def test_a_commit_changes_health_and_the_tokens(tmp_path: Path) -> None:
    host = sim_host()
    before, default_tokens = host.health(), tokens(await run(host, PROMPT))
    # The model's own weights make the tokens the simulator always made.
    assert default_tokens == [10 + (sum(PROMPT) + i) % 1000 for i in range(4)]
    await update(host, tmp_path, "v2")
    after = host.health()
    assert (after.weight_version, after.weights_path) == ("v2", str(tmp_path))
    assert before.compatibility_hash != after.compatibility_hash
    outs = await run(host, PROMPT)
    assert tokens(outs) != default_tokens
    assert [o.weight_version for o in outs] == ["v2", "", "", ""]  # the first output only
    await update(host, tmp_path, "v3")
    assert tokens(await run(host, PROMPT)) not in (default_tokens, tokens(outs))


async def test_one_version_continues_a_prefill_and_another_refuses_it(tmp_path: Path) -> None:
    prefill, decode, local = sim_host("prefill"), sim_host("decode"), sim_host("decode")
    for host in (prefill, decode, local):
        await update(host, tmp_path, "v2")
    (first,) = await run(prefill, PROMPT)
    assert first.weight_version == "v2" and first.kv_handle is not None
    assert first.kv_handle.weight_version == "v2"
    continued = await run(decode, PROMPT + first.token_ids, 3, kv_handle=first.kv_handle)
    assert [o.weight_version for o in continued] == ["v2", "", ""]
    # The same text as a decode that computed the prompt itself on the same weights.
    assert tokens([first, *continued]) == tokens(await run(local, PROMPT))
    await update(decode, tmp_path, "v3")
    with pytest.raises(WorkerError, match="'v2'.*'v3'") as refused:
        await run(decode, PROMPT + first.token_ids, 3, kv_handle=first.kv_handle)
    assert refused.value.kind == "failed_precondition"


async def test_no_commit_while_a_call_runs(tmp_path: Path) -> None:
    host = sim_host()
    await host.stage_weights(str(tmp_path), "v2")
    request = PhaseRequest("r-1", "decode", PROMPT, SamplingSpec(max_tokens=3))
    stream = host.generate(request)
    first = await anext(stream)
    with pytest.raises(WorkerError, match="in flight"):
        await host.commit_weights("v2")
    rest = [out async for out in stream]
    assert first.weight_version == "default" and len(rest) == 2
    await host.commit_weights("v2")
    assert host.health().weight_version == "v2"


async def test_only_the_calls_naming_a_version_change_it() -> None:
    host = sim_host()
    for call in (InitWeightTransferEngine(TransferInitInfo(packed=True)), StartWeightUpdate(),
                 UpdateWeights(TransferUpdateInfo()), ShutdownWeightTransferEngine()):
        assert await host.engine_weight_call(call) == "default"
    assert await host.engine_weight_call(FinishWeightUpdate()) == "default"
    assert await host.engine_weight_call(FinishWeightUpdate("step-1")) == "step-1"
    assert await host.engine_weight_call(UpdateWeightVersion("step-2")) == "step-2"
    health = host.health()
    assert (health.weight_version, health.weights_path) == ("step-2", "")


async def test_every_typed_weight_call_crosses_grpc_and_an_empty_one_is_refused() -> None:
    """Each call of vLLM's RL API travels as its own message of ``EngineWeightCall``'s
    oneof and comes out the same typed value; a request with no call set (or one newer
    than the worker knows) is INVALID_ARGUMENT, and changes nothing."""
    host = start_host(SimConfig("decode", "d-0"))
    worker = await start_worker_server(host, "127.0.0.1", 0)
    server, port = worker.server, worker.port
    client = WorkerClient(f"127.0.0.1:{port}")
    seen: list[WeightCall] = []
    original = host.engine_weight_call

    async def record(call: WeightCall) -> str:
        seen.append(call)
        return await original(call)

    host.engine_weight_call = record  # type: ignore[method-assign]
    calls: list[WeightCall] = [
        InitWeightTransferEngine(TransferInitInfo(master_address="127.0.0.1", master_port=29500,
                                                  rank_offset=1, world_size=2, packed=False)),
        InitWeightTransferEngine(TransferInitInfo()), StartWeightUpdate(),
        UpdateWeights(TransferUpdateInfo(names=("a", "b"), dtype_names=("float32", "bfloat16"),
                                         shapes=((2, 3), ()), tensor_sizes=(24, 2))),
        FinishWeightUpdate(), FinishWeightUpdate("v7"), UpdateWeightVersion("v8"),
        ShutdownWeightTransferEngine()]
    try:
        versions = [await client.engine_weight_call(call, 5) for call in calls]
        assert seen == calls
        assert versions == ["default"] * 5 + ["v7", "v8", "v8"]
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        stub = pb_grpc.WorkerServiceStub(channel)
        for request in (pb.EngineWeightCallRequest(),
                        pb.EngineWeightCallRequest.FromString(b"\x4a\x00")):  # field 9
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.EngineWeightCall(request, timeout=5)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "no call" in str(refused.value.details())
        await channel.close()
        assert len(seen) == len(calls) and host.health().weight_version == "v8"
    finally:
        await client.close()
        await server.stop(None)


async def test_a_sim_worker_changes_weights_over_grpc(tmp_path: Path) -> None:
    server, port, _ = await start_sim_worker(SimConfig("decode", "d-0", stage_weights_s=0.0))
    client = WorkerClient(f"127.0.0.1:{port}")
    try:
        with pytest.raises(WorkerCallError) as bad:
            await client.stage_weights(str(tmp_path / "missing"), "v2", 5)
        assert bad.value.code == "INVALID_ARGUMENT"
        await client.stage_weights(str(tmp_path), "v2", 5)
        done = await client.commit_weights("v2", False, 1.0, 5)
        assert done.weight_version == "v2"
        health = await client.health(5)
        assert (health.weight_version, health.weights_path) == ("v2", str(tmp_path))
    finally:
        await client.close()
        await server.stop(None)


def test_the_sim_worker_and_up_take_the_starting_version(tmp_path: Path) -> None:
    config = sim_config(build_parser().parse_args(
        ["sim-worker", "--weight-version", "v5", "--stage-weights-s", "0.5"]))
    assert (config.weight_version, config.stage_weights_s) == ("v5", 0.5)
    assert sim_host(weight_version="v5").health().weight_version == "v5"
    up = up_config(build_parser().parse_args(["up", "--simulated", "--weight-version", "v5"]),
                   ResolvedModel(Path("/models/tiny"), "tiny"))
    for child in [c for c in plan(up, tmp_path) if c.name != "router"]:
        assert sim_config(build_parser().parse_args(child.argv[3:])).weight_version == "v5"
