"""The admin plane's actions: calls that change the cluster, as opposed to the views
(``/metrics``, ``/workers``, ``/prefix_index``). Who may call them is the admin app's
middleware's to decide (``auth.py``), before any of these reads a body.

``POST /admin/workers/{id}/role`` switches a worker's role (``router/cluster/roles.py``);
the rest are vLLM's RL routes and SGLang's ``/update_weights_from_disk``
(``router/cluster/weight_updates.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query

from pdserve.core.weight_calls import (
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    UpdateWeights,
    UpdateWeightVersion,
)
from pdserve.router.cluster.roles import RoleSwitcher
from pdserve.router.cluster.weight_updates import WeightUpdater
from pdserve.router.http.admin.bodies import (
    AbortRequestsBody,
    FinishWeightUpdateBody,
    InitTransferBody,
    PauseQuery,
    RoleSwitchBody,
    UpdateFromDiskBody,
    UpdateWeightsBody,
    WeightVersionBody,
    typed_init_info,
    typed_update_info,
)
from pdserve.router.http.admin.transfer import WeightTransferPolicy
from pdserve.router.http.openapi import ERROR_RESPONSES


def admin_actions(switcher: RoleSwitcher, weights: WeightUpdater | None = None,
                  transfer: WeightTransferPolicy | None = None) -> APIRouter:
    router = APIRouter(responses=ERROR_RESPONSES)
    if weights is not None:
        router.include_router(weight_actions(weights))
        router.include_router(transfer_actions(weights, transfer or WeightTransferPolicy()))

    @router.post("/admin/workers/{worker_id}/role")
    async def switch_role(worker_id: str, body: RoleSwitchBody) -> dict[str, Any]:
        """Switch a worker between prefill and decode without restarting it; answers
        once it serves the new role."""
        outcome = await switcher.switch(worker_id, body.role, body.drain_timeout_s,
                                        body.force)
        return outcome.body()

    return router


def weight_actions(weights: WeightUpdater) -> APIRouter:
    """vLLM's RL routes that need no transfer engine (names, bodies and answers as
    ``vllm serve`` has them) and SGLang's ``/update_weights_from_disk``."""
    router = APIRouter(responses=ERROR_RESPONSES)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskBody) -> dict[str, Any]:
        """Load a checkpoint folder into every worker in place: all stage it, then all
        switch (``policy``: drain or abort what runs); a failed stage changes nothing."""
        return await weights.update_from_disk(body.update())

    @router.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return weights.info()

    @router.post("/pause")
    async def pause(query: Annotated[PauseQuery, Query()]) -> dict[str, Any]:
        await weights.pause(query.mode, query.clear_cache, query.timeout)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        weights.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": weights.paused}

    @router.post("/abort_requests")
    async def abort_requests(body: AbortRequestsBody | None = None) -> dict[str, Any]:
        ids = None if body is None else body.request_ids
        return {"status": "aborted", "aborted": await weights.abort_requests(ids or None)}

    @router.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionBody) -> dict[str, Any]:
        await weights.engine_call(UpdateWeightVersion(body.new_version))
        return {"success": True, "new_version": body.new_version}

    return router


def transfer_actions(weights: WeightUpdater, transfer: WeightTransferPolicy) -> APIRouter:
    """vLLM's transfer-engine calls, passed to every worker: 404 unless the router runs
    with ``--weight-transfer-backend``, their hosts held to ``--weight-transfer-allow``
    (``transfer.py``) before any worker is called."""
    router = APIRouter(dependencies=[Depends(transfer.require_enabled)],
                       responses=ERROR_RESPONSES)

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(body: InitTransferBody) -> dict[str, Any]:
        init_info = await transfer.checked(body.init_info, "init_info")
        await weights.engine_call(InitWeightTransferEngine(typed_init_info(init_info)))
        return {"message": "Weight transfer initialized"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        await weights.engine_call(ShutdownWeightTransferEngine())
        return {"message": "Weight transfer shut down"}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        await weights.engine_call(StartWeightUpdate())
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(body: UpdateWeightsBody) -> dict[str, Any]:
        update_info = await transfer.checked(body.update_info, "update_info")
        await weights.engine_call(UpdateWeights(typed_update_info(update_info)))
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(body: FinishWeightUpdateBody | None = None
                                   ) -> dict[str, Any]:
        version = None if body is None else body.weight_version
        await weights.engine_call(FinishWeightUpdate(version))
        return {"message": "Weight update finished"}

    return router
