"""The admin listener's actions (``--admin-port``): calls that change the cluster, as
opposed to the read-only views (``/metrics``, ``/workers``, ``/prefix_index``).

``POST /admin/workers/{id}/role`` switches a worker's role (``roles.py``). Every action
needs ``Authorization: Bearer <key>`` with an admin key (``--admin-key``), or, when no
admin key is set, a client API key (``--api-key``). With no key at all, actions are
served only on a loopback admin address (the machine's own users): a cluster-changing
call is never open to the network.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Query, Request

from pdserve.router.http.edge.auth import ApiKeys
from pdserve.router.http.errors import InvalidRequestError, PermissionDeniedError
from pdserve.router.http.openapi import ERROR_RESPONSES
from pdserve.router.http.roles import RoleSwitchBody, RoleSwitcher
from pdserve.router.http.weight_updates import UpdateFromDiskBody, WeightUpdater

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


class AdminAuth:
    """Who may call an admin action: a holder of one of ``keys``; with none, anyone
    reaching a loopback listener (``admin_host``), nobody otherwise."""

    def __init__(self, keys: Sequence[str], admin_host: str) -> None:
        self._keys = ApiKeys(keys)
        self._open = not keys and admin_host in LOOPBACK_HOSTS

    def check(self, request: Request) -> None:
        """Raises the error to answer with (401 / 403)."""
        if self._keys:
            header = request.headers.get("authorization")
            error = self._keys.check(None if header is None else header.encode())
            if error is not None:
                raise error
            return
        if not self._open:
            raise PermissionDeniedError(
                "admin actions need a key on a non-loopback admin listener: set --admin-key "
                "(or --api-key)", code="admin_key_required")


def admin_actions(switcher: RoleSwitcher, auth: AdminAuth,
                  weights: WeightUpdater | None = None) -> APIRouter:
    router = APIRouter()
    if weights is not None:
        router.include_router(weight_actions(weights, auth))

    # A dependency: checked before the body is read, so a caller without the key learns
    # nothing about what the body should be.
    @router.post("/admin/workers/{worker_id}/role", responses=ERROR_RESPONSES,
                 dependencies=[Depends(auth.check)])
    async def switch_role(worker_id: str, body: RoleSwitchBody) -> dict[str, Any]:
        """Switch a worker between prefill and decode without restarting it; answers
        once it serves the new role."""
        outcome = await switcher.switch(worker_id, body.role, body.drain_timeout_s,
                                        body.force)
        return outcome.body()

    return router


def weight_actions(weights: WeightUpdater, auth: AdminAuth) -> APIRouter:
    """vLLM's RL routes (names, bodies and answers as ``vllm serve`` has them) and
    SGLang's ``/update_weights_from_disk``, for the whole cluster (``weight_updates.py``)."""
    router = APIRouter(dependencies=[Depends(auth.check)], responses=ERROR_RESPONSES)

    @router.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateFromDiskBody) -> dict[str, Any]:
        """Load a checkpoint folder into every worker in place: all stage it, then all
        switch (``policy``: drain or abort what runs); a failed stage changes nothing."""
        return await weights.update_from_disk(body)

    @router.get("/weight_info")
    async def weight_info() -> dict[str, Any]:
        return weights.info()

    @router.post("/pause")
    async def pause(mode: str = Query("abort"), clear_cache: bool = Query(True)
                    ) -> dict[str, Any]:
        await weights.pause(mode)
        return {"status": "paused"}

    @router.post("/resume")
    async def resume() -> dict[str, Any]:
        weights.resume()
        return {"status": "resumed"}

    @router.get("/is_paused")
    async def is_paused() -> dict[str, Any]:
        return {"is_paused": weights.paused}

    @router.post("/abort_requests")
    async def abort_requests(body: dict[str, Any] | None = None) -> dict[str, Any]:
        ids = (body or {}).get("request_ids")
        if ids is not None and not (isinstance(ids, list)
                                    and all(isinstance(i, str) for i in ids)):
            raise InvalidRequestError("request_ids must be a list of strings",
                                      param="request_ids")
        return {"status": "aborted", "aborted": await weights.abort_requests(ids or None)}

    @router.post("/init_weight_transfer_engine")
    async def init_weight_transfer_engine(
            init_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict[str, Any]:
        await weights.engine_call("init_weight_transfer_engine", {"init_info": init_info})
        return {"message": "Weight transfer initialized"}

    @router.post("/shutdown_weight_transfer_engine")
    async def shutdown_weight_transfer_engine() -> dict[str, Any]:
        await weights.engine_call("shutdown_weight_transfer_engine", {})
        return {"message": "Weight transfer shut down"}

    @router.post("/start_weight_update")
    async def start_weight_update() -> dict[str, Any]:
        await weights.engine_call("start_weight_update", {})
        return {"message": "Weight update started"}

    @router.post("/update_weights")
    async def update_weights(
            update_info: Annotated[dict[str, Any], Body(embed=True)]) -> dict[str, Any]:
        await weights.engine_call("update_weights", {"update_info": update_info})
        return {"message": "Weights updated"}

    @router.post("/finish_weight_update")
    async def finish_weight_update(weight_version: str | None = Body(None, embed=True)
                                   ) -> dict[str, Any]:
        await weights.engine_call("finish_weight_update", {"weight_version": weight_version})
        return {"message": "Weight update finished"}

    @router.post("/update_weight_version")
    async def update_weight_version(new_version: str = Body(embed=True, min_length=1)
                                    ) -> dict[str, Any]:
        await weights.engine_call("update_weight_version", {"new_version": new_version})
        return {"success": True, "new_version": new_version}

    return router
