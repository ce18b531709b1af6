"""vLLM's weight-transfer calls as typed values: one frozen dataclass per call of vLLM's
RL API (its HTTP route and ``AsyncLLM`` method of the same name), what the router's
admin routes build, ``EngineWeightCall`` carries (``worker.proto``: a ``oneof`` of one
message per call) and the worker runs, each call by its own method.

``init_info`` and ``update_info``, free-form dicts in vLLM's bodies, are typed as the
union of the fields of the backends pdserve takes (``TransferInitInfo``,
``TransferUpdateInfo``); a field left ``None`` is not sent to vLLM, whose default then
applies. ``vllm_dict`` gives the dict vLLM's engine parses.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass(frozen=True)
class TransferInitInfo:
    """vLLM's ``init_info``: how a worker joins the trainer's transfer group."""

    master_address: str | None = None
    master_port: int | None = None
    rank_offset: int | None = None
    world_size: int | None = None
    nccl_unique_id_b64: str | None = None
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = None
    packed_num_buffers: int | None = None

    def vllm_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class TransferUpdateInfo:
    """vLLM's ``update_info``: one round's tensors, parallel lists (``tensor_sizes``:
    ipc's packed form only)."""

    names: tuple[str, ...] = ()
    dtype_names: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()
    tensor_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(f"update_info: names, dtype_names and shapes must be as long "
                             f"as each other ({len(self.names)}, {len(self.dtype_names)}, "
                             f"{len(self.shapes)})")

    def vllm_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"names": list(self.names), "dtype_names": list(self.dtype_names),
                               "shapes": [list(s) for s in self.shapes]}
        if self.tensor_sizes is not None:
            out["tensor_sizes"] = list(self.tensor_sizes)
        return out


@dataclass(frozen=True)
class InitWeightTransferEngine:
    init_info: TransferInitInfo
    name: ClassVar[str] = "init_weight_transfer_engine"


@dataclass(frozen=True)
class StartWeightUpdate:
    name: ClassVar[str] = "start_weight_update"


@dataclass(frozen=True)
class UpdateWeights:
    update_info: TransferUpdateInfo
    name: ClassVar[str] = "update_weights"


@dataclass(frozen=True)
class FinishWeightUpdate:
    weight_version: str | None = None
    name: ClassVar[str] = "finish_weight_update"


@dataclass(frozen=True)
class UpdateWeightVersion:
    new_version: str
    name: ClassVar[str] = "update_weight_version"

    def __post_init__(self) -> None:
        if not self.new_version:
            raise ValueError("new_version must not be empty")


@dataclass(frozen=True)
class ShutdownWeightTransferEngine:
    name: ClassVar[str] = "shutdown_weight_transfer_engine"


WeightCall = (InitWeightTransferEngine | StartWeightUpdate | UpdateWeights
              | FinishWeightUpdate | UpdateWeightVersion | ShutdownWeightTransferEngine)
# Every call, by vLLM's name for it (its HTTP route).
WEIGHT_CALLS: tuple[type[WeightCall], ...] = (
    InitWeightTransferEngine, StartWeightUpdate, UpdateWeights, FinishWeightUpdate,
    UpdateWeightVersion, ShutdownWeightTransferEngine)


def version_set_by(call: WeightCall) -> str | None:
    """The version ``call`` makes the engine serve under (None: it names none)."""
    if isinstance(call, FinishWeightUpdate):
        return call.weight_version
    if isinstance(call, UpdateWeightVersion):
        return call.new_version
    return None
