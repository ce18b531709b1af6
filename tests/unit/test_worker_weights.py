"""A worker's weights on the host (``pdserve.worker.weights``): KV and cache names stay
within one version, and a commit needs what was staged and nothing in flight."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from unit.test_engine_host import FakeEngine, Released, handle, request, run, started

from pdserve.core.handle import KVHandle
from pdserve.roles.decode.policy import DecodePolicy
from pdserve.roles.prefill.policy import PrefillPolicy
from pdserve.worker.backend import WorkerError
from pdserve.worker.engine import EngineStep
from pdserve.worker.vllm.weights_ext import StagingError, check_checkpoint


async def test_a_decode_worker_refuses_kv_stamped_with_another_weights_version() -> None:
    engine = FakeEngine([EngineStep((5,), True, "length")])
    host = started("decode", DecodePolicy(), engine)
    await host.stage_weights("/ckpt/v2", "v2")
    await host.commit_weights("v2")
    old = replace(handle(), weight_version="default")
    with pytest.raises(WorkerError) as refused:
        await run(host, request("decode", 5, kv_handle=old))
    assert refused.value.kind == "failed_precondition"
    assert "'default'" in str(refused.value) and "'v2'" in str(refused.value)
    assert engine.calls == []  # never reached the engine: no KV was loaded
    outs = await run(host, request("decode", 5, kv_handle=replace(old, weight_version="v2")))
    assert outs[0].weight_version == "v2" and len(engine.calls) == 1


async def test_a_prefill_stamps_its_handle_and_first_output_with_its_version() -> None:
    h = handle()
    engine = FakeEngine([EngineStep((), False), EngineStep((7,), True, "length", h.to_params())])
    host = started("prefill", PrefillPolicy(release=Released()), engine)
    await host.stage_weights("/ckpt/v3", "v3")
    await host.commit_weights("v3")
    outs = await run(host, request("prefill", 8))
    assert [o.weight_version for o in outs] == ["v3", ""]  # the call's first output only
    assert outs[-1].kv_handle == replace(h, weight_version="v3")


async def test_after_an_update_requests_are_cached_under_the_versioned_salt() -> None:
    engine = FakeEngine([EngineStep((5,), True, "length")])
    host = started("decode", DecodePolicy(), engine)
    before = host.health()
    await run(host, request("decode", 5))
    await host.stage_weights("/ckpt/v2", "v2")
    await host.commit_weights("v2")
    await run(host, request("decode", 5))
    assert engine.calls[0][2].cache_salt is None  # the first weights: names unchanged
    assert engine.calls[1][2].cache_salt == "@weights:v2"
    after = host.health()
    assert (after.weight_version, after.weights_path) == ("v2", "/ckpt/v2")
    assert after.compatibility_hash != before.compatibility_hash


async def test_a_commit_needs_that_version_staged_and_a_bad_checkpoint_stages_nothing() -> None:
    engine = FakeEngine([EngineStep((5,), True, "length")])
    host = started("decode", DecodePolicy(), engine)
    with pytest.raises(WorkerError, match="nothing is staged"):
        await host.commit_weights("v2")
    await host.stage_weights("/ckpt/v2", "v2")
    with pytest.raises(WorkerError, match="version 'v2' is staged"):
        await host.commit_weights("v9")
    with pytest.raises(ValueError, match="layout"):
        await host.stage_weights("/bad/v3", "v3")
    with pytest.raises(WorkerError, match="nothing is staged"):  # the failed stage replaced it
        await host.commit_weights("v2")
    assert engine.committed == [] and host.health().weight_version == "default"


def test_a_handle_without_a_version_is_the_first_weights() -> None:
    params = handle().to_params()
    del params["weight_version"]
    assert KVHandle.from_params(params).weight_version == "default"


def _checkpoint(folder: Path, **tensors: tuple[int, ...]) -> Path:
    folder.mkdir()
    save_file({name: torch.zeros(shape) for name, shape in tensors.items()},
              str(folder / "model.safetensors"))
    return folder


def test_a_checkpoint_must_have_the_served_models_tensors_and_shapes(tmp_path: Path) -> None:
    served = _checkpoint(tmp_path / "served", a=(2, 3), b=(4,))
    check_checkpoint(_checkpoint(tmp_path / "same", a=(2, 3), b=(4,)), served)
    for name, tensors, problem in (
            ("missing", {"a": (2, 3)}, "missing, e.g. 'b'"),
            ("extra", {"a": (2, 3), "b": (4,), "c": (1,)}, "not in the served model"),
            ("shape", {"a": (3, 2), "b": (4,)}, "'a' has shape [3, 2]")):
        with pytest.raises(StagingError, match=re.escape(problem)):
            check_checkpoint(_checkpoint(tmp_path / name, **tensors), served)
    (tmp_path / "empty").mkdir()
    with pytest.raises(StagingError, match="no \\*.safetensors"):
        check_checkpoint(tmp_path / "empty", served)
    with pytest.raises(StagingError, match="not a directory"):
        check_checkpoint(tmp_path / "nowhere", served)
