"""vLLM's LoRA routes on the admin plane: ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (names and bodies as ``vllm serve`` has them), fanned out to
every worker by the router's ``LoraCatalog`` and replayed on workers that join later.
They change what every client's requests run, so they are the admin key's, not a
client key's (``auth.py``). The answer names each worker's outcome."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from pdserve.core.lora import MAX_NAME_CHARS, MAX_PATH_CHARS, LoraAdapter
from pdserve.router.dispatch.lora_catalog import (
    LoraCatalog,
    LoraNotLoadedError,
    LoraRefusedError,
)
from pdserve.router.http.errors import (
    ConflictError,
    InvalidRequestError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from pdserve.router.http.openapi import ERROR_RESPONSES


class LoadLoraBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest``. A name served already from another folder is a
    refit of that adapter (vLLM's ``load_inplace``, taken either way). ``load_inplace``
    with the folder already served (a trainer that rewrote it in place) is refused, 409:
    the folder names the adapter's KV and the workers' copy, so new weights need a new
    folder (reloading the same one would serve them under the old weights' cache)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_path: str = Field(min_length=1, max_length=MAX_PATH_CHARS)
    load_inplace: bool = False


class UnloadLoraBody(BaseModel):
    """vLLM's ``UnloadLoRAAdapterRequest`` (``lora_int_id`` is vLLM's own: ignored)."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    lora_int_id: int | None = None


def lora_actions(catalog: LoraCatalog, base_model: str) -> APIRouter:
    router = APIRouter(responses=ERROR_RESPONSES)

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraBody) -> dict[str, Any]:
        if body.lora_name == base_model:
            raise InvalidRequestError(f"'{body.lora_name}' is the base model's name",
                                      param="lora_name")
        try:
            adapter = LoraAdapter(body.lora_name, body.lora_path)
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        if body.load_inplace and catalog.adapter(adapter.name) == adapter:
            raise ConflictError(
                f"LoRA {adapter.name!r} is served from {adapter.path!r} already: pdserve "
                "names an adapter's weights (and the KV cached under them) by its folder, "
                "so a refit must load the new weights from a new folder",
                code="lora_folder_unchanged")
        try:
            outcome = await catalog.load(adapter)
        except (ValueError, LoraRefusedError) as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        except LoraNotLoadedError as exc:
            raise ServiceUnavailableError(str(exc)) from None
        return {"status": "success", "lora_name": adapter.name, "lora_path": adapter.path,
                "lora_tag": adapter.tag, "workers": outcome.workers}

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraBody) -> dict[str, Any]:
        try:
            outcome = await catalog.unload(body.lora_name)
        except KeyError:
            raise ModelNotFoundError(body.lora_name) from None
        return {"status": "success", "lora_name": body.lora_name, "workers": outcome.workers}

    return router
