"""pdserve's gloo weight-transfer engine (``worker/vllm/gloo_transfer.py``) without an engine:
the worker side's ``receive_weights`` takes what a trainer in another process
broadcasts over a real gloo group and hands each tensor, by name, to the model's
``load_weights``; a dtype name that is not a torch dtype is refused before anything
is received; the plugin registers the backend with vLLM's factory."""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from unit.gloo_trainer import TENSORS, trainer_main

from pdserve.core.ports import free_port
from pdserve.worker.vllm.gloo_transfer import (
    GlooTrainer,
    GlooWeightTransferEngine,
    GlooWeightTransferInitInfo,
    GlooWeightTransferUpdateInfo,
    dtype_of,
)
from pdserve.worker.vllm.plugin import register_gloo_transfer


class RecordingModel:
    def __init__(self) -> None:
        self.loaded: dict[str, torch.Tensor] = {}

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.loaded.update(weights)


def engine_for(model: RecordingModel) -> GlooWeightTransferEngine:
    """The engine with what vLLM's worker would give it, but a model that records."""
    engine = object.__new__(GlooWeightTransferEngine)
    engine.model = model  # type: ignore[assignment]
    engine.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(  # type: ignore
        data_parallel_index=0, world_size=1, rank=0))
    engine.group = None
    return engine


def test_the_worker_side_loads_each_tensor_the_trainer_broadcasts() -> None:
    port = free_port()
    trainer = mp.get_context("spawn").Process(target=trainer_main, args=(port,))
    trainer.start()
    model = RecordingModel()
    engine = engine_for(model)
    try:
        engine.init_transfer_engine(GlooWeightTransferInitInfo("127.0.0.1", port, 1, 2))
        info: dict[str, Any] = GlooTrainer.update_info(sorted(TENSORS.items()))
        assert info == {"names": ["a.weight", "b.bias"], "dtype_names": ["float32", "bfloat16"],
                        "shapes": [[2, 3], [2]]}
        engine.receive_weights(GlooWeightTransferUpdateInfo(**info))
    finally:
        engine.shutdown()
        trainer.join(60)
    assert trainer.exitcode == 0
    assert model.loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert torch.equal(model.loaded[name], tensor) and model.loaded[name].dtype == tensor.dtype


@pytest.mark.parametrize("name", ["load", "nn", "float32.__class__", "Tensor", ""])
def test_a_dtype_name_that_is_not_a_torch_dtype_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="not a torch dtype"):
        dtype_of(name)
    with pytest.raises(ValueError, match="not a torch dtype"):
        GlooWeightTransferUpdateInfo(names=["w"], dtype_names=[name], shapes=[[1]])


def test_receiving_before_the_group_exists_fails_plainly() -> None:
    engine = engine_for(RecordingModel())
    with pytest.raises(RuntimeError, match="init_weight_transfer_engine first"):
        engine.receive_weights(GlooWeightTransferUpdateInfo(["w"], ["float32"], [[1]]))


def test_the_plugin_registers_gloo_with_vllms_factory_once() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    register_gloo_transfer()
    register_gloo_transfer()  # a second call (vLLM may load plugins twice) is no error
    loader = WeightTransferEngineFactory._registry["gloo"]
    assert loader() is GlooWeightTransferEngine
