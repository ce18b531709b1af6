"""A weight-transfer backend for vLLM without a GPU: the trainer's tensors broadcast over a
gloo process group, into the engine by vLLM's own transfer-engine path (its
``WeightTransferEngine``: ``start_weight_update`` opens vLLM's layerwise reload, every
``update_weights`` round loads its tensors with the model's ``load_weights``,
``finish_weight_update`` finalizes the reload). Registered as ``gloo`` with vLLM's
``WeightTransferEngineFactory`` by pdserve's vLLM plugin (``vllm_plugin.register``),
in every engine process.

vLLM 0.32's own backends cannot move a tensor on a CPU: ``nccl`` (and ``sparse_nccl``,
``nccl_m2n``) make a ``PyNcclCommunicator`` on ``torch.accelerator.current_device_index()``
(``vllm/distributed/weight_transfer/nccl_common.py``, ``worker_init_process_group``),
and ``ipc`` rebuilds CUDA tensors from CUDA IPC handles (``ipc_engine.py``,
``receive_weights``: ``torch.cuda.get_device_properties``, ``rebuild_cuda_tensor``).
This one is NCCL's dense, unpacked protocol on gloo: the same ``init_info`` rendezvous
fields (``master_address``, ``master_port``, ``rank_offset``, ``world_size``: a TCP
store, held to the router's ``--weight-transfer-allow``) and the same ``update_info``
(``names``, ``dtype_names``, ``shapes``), the trainer at rank 0 broadcasting each tensor
in that order (``GlooTrainer``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from vllm.distributed.utils import (
    stateless_destroy_torch_distributed_process_group,
    stateless_init_torch_distributed_process_group,
)
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from pdserve.worker.vllm.weights_ext import refresh_embedding_kernels

BACKEND = "gloo"
# The longest a rendezvous or one broadcast waits for the other side.
GROUP_TIMEOUT_S = 120.0


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype named ``name`` ("float32"); ``ValueError`` for anything else (the
    name comes from the trainer: never any other attribute of torch)."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"update_info.dtype_names: {name!r} is not a torch dtype")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("update_info: names, dtype_names and shapes must be as long as "
                             "each other")
        for name in self.dtype_names:
            dtype_of(name)


class GlooWeightTransferEngine(
        WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """The worker side: joins the trainer's gloo group, receives each broadcast tensor
    and loads it (vLLM's worker calls these from its own RL methods)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group: Any = None

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        if self.group is not None:
            self.shutdown()
        parallel = self.vllm_config.parallel_config
        rank = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.group = stateless_init_torch_distributed_process_group(
            init_info.master_address, init_info.master_port, rank + init_info.rank_offset,
            init_info.world_size, BACKEND, timeout=timedelta(seconds=GROUP_TIMEOUT_S))

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)
        # A head tied to the embedding loads nothing of its own: on CPU its packed GEMM
        # copy would keep the old weights (as after pdserve's own commit).
        refresh_embedding_kernels(self.model)

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer not initialized: call "
                               "init_weight_transfer_engine first")
        model: Any = self.model  # vLLM's models all have load_weights; nn.Module does not
        for name, dtype, shape in zip(update_info.names, update_info.dtype_names,
                                      update_info.shapes, strict=True):
            tensor = torch.empty(shape, dtype=dtype_of(dtype))
            self.group.broadcast(tensor, root=0).wait()
            model.load_weights([(name, tensor)])

    def shutdown(self) -> None:
        if self.group is not None:
            stateless_destroy_torch_distributed_process_group(self.group)
            self.group = None


class GlooTrainer:
    """The trainer side (rank 0 of the group): what an RL trainer on a CPU host runs
    beside its HTTP calls to the router's admin routes. ``open`` blocks until every
    worker joined (the router's ``init_weight_transfer_engine``, sent meanwhile);
    ``send`` broadcasts one round (the router's ``update_weights`` with
    ``update_info(tensors)``, sent meanwhile)."""

    def __init__(self, group: Any) -> None:
        self._group = group

    @classmethod
    def open(cls, master_address: str, master_port: int, world_size: int,
             timeout_s: float = GROUP_TIMEOUT_S) -> GlooTrainer:
        return cls(stateless_init_torch_distributed_process_group(
            master_address, master_port, 0, world_size, BACKEND,
            timeout=timedelta(seconds=timeout_s)))

    @staticmethod
    def update_info(tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[Any]]:
        """The ``update_info`` body that announces ``tensors``, in their order."""
        named = list(tensors)
        return {"names": [n for n, _ in named],
                "dtype_names": [dtype_name(t.dtype) for _, t in named],
                "shapes": [list(t.shape) for _, t in named]}

    def send(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        for _, tensor in tensors:
            self._group.broadcast(tensor.detach().contiguous().cpu(), root=0).wait()

    def close(self) -> None:
        stateless_destroy_torch_distributed_process_group(self._group)
