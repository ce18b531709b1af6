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
from typing import Any

from fastapi import APIRouter, Depends, Request

from pdserve.router.http.auth import ApiKeys
from pdserve.router.http.errors import PermissionDeniedError
from pdserve.router.http.openapi import ERROR_RESPONSES
from pdserve.router.http.roles import RoleSwitchBody, RoleSwitcher

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


def admin_actions(switcher: RoleSwitcher, auth: AdminAuth) -> APIRouter:
    router = APIRouter()

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
