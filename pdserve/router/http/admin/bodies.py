"""The admin routes' bodies and queries, each a pydantic model: vLLM's RL API's names
and fields (``vllm/entrypoints/rl/online/api_router.py``), SGLang's for an update from
disk, and pdserve's own role switch; a bad one is a 400 in OpenAI's error JSON
(``errors.py``), after the admin key (``auth.py``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.core.weight_calls import TransferInitInfo, TransferUpdateInfo
from pdserve.router.cluster import roles, weight_updates
from pdserve.router.http.errors import InvalidRequestError

MAX_REQUEST_IDS = 10_000
U32 = 2**32 - 1
U64 = 2**64 - 1
VERSION_MAX_CHARS = 200


class RoleSwitchBody(BaseModel):
    """``POST /admin/workers/{id}/role``'s body."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["prefill", "decode"]
    drain_timeout_s: float = Field(roles.DEFAULT_DRAIN_TIMEOUT_S, ge=0, le=3600)
    force: bool = False  # allow switching the last decode worker of its model away


class UpdateFromDiskBody(BaseModel):
    """``POST /update_weights_from_disk`` (SGLang's name and fields, plus the policy)."""

    model_config = ConfigDict(extra="ignore")  # RL frameworks send SGLang's other fields
    model_path: str = Field(min_length=1)
    weight_version: str | None = Field(None, min_length=1, max_length=200)
    policy: Literal["drain", "abort", "keep"] = "drain"
    drain_timeout_s: float = Field(weight_updates.DEFAULT_DRAIN_TIMEOUT_S, ge=0, le=3600)
    # How long a worker may take to read the checkpoint: past it (a hung worker) the
    # update fails and every worker keeps its version.
    stage_timeout_s: float = Field(weight_updates.STAGE_TIMEOUT_S, gt=0, le=3600)

    def update(self) -> weight_updates.DiskUpdate:
        return weight_updates.DiskUpdate(**self.model_dump())


class _Lenient(BaseModel):
    # RL frameworks send their own extra fields (as to vllm serve): ignored, not refused.
    model_config = ConfigDict(extra="ignore")


class PauseQuery(BaseModel):
    """``POST /pause?mode=&clear_cache=``."""

    model_config = ConfigDict(extra="forbid")
    mode: Literal["abort", "wait", "keep"] = "abort"
    clear_cache: bool = True
    # ``wait``: how long running requests may take to finish; past it they are ended
    # (as ``abort``). vLLM's ``/pause`` waits without a bound; a router's cannot.
    timeout: float = Field(600.0, gt=0, le=3600)


class AbortRequestsBody(_Lenient):
    """``POST /abort_requests``: those ids, or (none) every running request."""

    request_ids: list[str] | None = Field(None, max_length=MAX_REQUEST_IDS)


class InitTransferBody(_Lenient):
    """``POST /init_weight_transfer_engine``: the backend's init info (its host fields
    held to ``--weight-transfer-allow``, ``transfer.py``)."""

    init_info: dict[str, Any]


class UpdateWeightsBody(_Lenient):
    """``POST /update_weights``: the backend's update info (checked as init info is)."""

    update_info: dict[str, Any]


class FinishWeightUpdateBody(_Lenient):
    weight_version: str | None = Field(None, min_length=1, max_length=VERSION_MAX_CHARS)


class WeightVersionBody(_Lenient):
    new_version: str = Field(min_length=1, max_length=VERSION_MAX_CHARS)


class InitInfoFields(BaseModel):
    """``init_info``'s fields, typed as ``worker.proto``'s ``TransferInitInfo``: the
    union of the nccl, ipc and gloo engines' (which a backend takes is
    ``transfer.KNOWN_FIELDS``' to say, checked first)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    master_address: str | None = None
    master_port: int | None = Field(None, ge=1, le=65535)
    rank_offset: int | None = Field(None, ge=0, le=U32)
    world_size: int | None = Field(None, ge=1, le=U32)
    nccl_unique_id_b64: str | None = None
    packed: bool | None = None
    packed_buffer_size_bytes: int | None = Field(None, ge=1, le=U64)
    packed_num_buffers: int | None = Field(None, ge=1, le=U32)


class UpdateInfoFields(BaseModel):
    """``update_info``'s fields, typed as ``worker.proto``'s ``TransferUpdateInfo``."""

    model_config = ConfigDict(extra="forbid", strict=True)
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[Annotated[int, Field(ge=0, le=U64)]]]
    tensor_sizes: list[Annotated[int, Field(ge=0, le=U64)]] | None = None


def typed_init_info(info: dict[str, Any]) -> TransferInitInfo:
    """``info`` (checked by ``transfer.py``) as the typed value; a 400 for a bad type."""
    try:
        return TransferInitInfo(**InitInfoFields.model_validate(info).model_dump())
    except ValidationError as exc:
        raise _invalid("init_info", exc) from None


def typed_update_info(info: dict[str, Any]) -> TransferUpdateInfo:
    """``info`` (checked by ``transfer.py``) as the typed value; a 400 for a bad type or
    lists of different lengths."""
    try:
        fields = UpdateInfoFields.model_validate(info)
        return TransferUpdateInfo(
            names=tuple(fields.names), dtype_names=tuple(fields.dtype_names),
            shapes=tuple(tuple(s) for s in fields.shapes),
            tensor_sizes=None if fields.tensor_sizes is None else tuple(fields.tensor_sizes))
    except (ValidationError, ValueError) as exc:
        raise _invalid("update_info", exc) from None


def _invalid(param: str, exc: ValueError) -> InvalidRequestError:
    if isinstance(exc, ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(p) for p in (param, *first["loc"]))
        return InvalidRequestError(f"{where}: {first['msg']}", param=param)
    return InvalidRequestError(str(exc), param=param)
