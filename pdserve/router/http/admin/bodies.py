"""The admin routes' bodies and queries, each a pydantic model: vLLM's RL API's names
and fields (``vllm/entrypoints/rl/online/api_router.py``); a bad one is a 400 in
OpenAI's error JSON (``errors.py``), after the admin key (``auth.py``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_REQUEST_IDS = 10_000
VERSION_MAX_CHARS = 200


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
