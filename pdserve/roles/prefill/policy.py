"""The prefill role on the shared engine host: compute the prompt and the first
token, keep the prompt's KV for a decode (``do_remote_decode``) under a lease,
and optionally push it layer by layer to the decode the router named; how many
prompts the engine computes at once, in what order (``admission.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

from pdserve.core.handle import KVHandle
from pdserve.core.types import PhaseRequest, Role
from pdserve.roles.prefill.admission import AdmissionConfig, PrefillAdmission
from pdserve.roles.prefill.handle_leases import HandleLeases, release_over_control
from pdserve.worker.engine import EngineParams


class PrefillPolicy:
    """``kv_push``: push when the router names a target. ``release`` frees a handle's
    blocks (blocking; tests pass a fake)."""

    def __init__(self, kv_push: bool = False,
                 release: Callable[[KVHandle], None] = release_over_control,
                 admission: AdmissionConfig | None = None) -> None:
        """``admission``: how many prompts the engine computes at once, in what order
        (``admission.py``; default: no limit)."""
        self.kv_push = kv_push
        self.admission = PrefillAdmission(admission or AdmissionConfig())
        self.leases = HandleLeases()
        self._release = release

    @property
    def role(self) -> Role:
        return "prefill"

    @staticmethod
    def holds_kv(request: PhaseRequest) -> bool:
        """A decode follows only when more than the first token is wanted."""
        return request.sampling.max_tokens > 1

    def admitted(self, request: PhaseRequest) -> AbstractAsyncContextManager[float]:
        return self.admission.admitted(len(request.prompt_token_ids), request.request_id)

    def abort_waiting(self, request_id: str) -> bool:
        return self.admission.abort(request_id)

    @property
    def num_waiting(self) -> int:
        return self.admission.num_waiting

    def engine_params(self, request: PhaseRequest) -> EngineParams:
        params: dict[str, Any] | None = None
        if self.holds_kv(request):
            params = {"do_remote_decode": True}
            if request.push_target is not None and self.kv_push:
                params["push"] = request.push_target.to_params()
        if request.pool_source is not None:  # a peer's host tier holds the prompt's head
            params = params if params is not None else {}
            params["pool"] = request.pool_source.to_params()
        return EngineParams(max_tokens=1, kv_transfer_params=params,
                            prompt_logprobs=request.sampling.prompt_logprobs)

    def on_finished(self, request: PhaseRequest,
                    kv_transfer_params: dict[str, Any] | None) -> KVHandle | None:
        if not kv_transfer_params or not self.holds_kv(request):
            return None
        handle = KVHandle.from_params(kv_transfer_params)
        self.leases.hold(request.request_id, handle)
        return handle

    async def release(self, request_id: str) -> bool:
        handle = self.leases.pop(request_id)
        if handle is None:
            return False
        await asyncio.to_thread(self._release, handle)
        return True

    async def release_all(self) -> int:
        request_ids = self.leases.request_ids()
        for request_id in request_ids:
            await self.release(request_id)
        return len(request_ids)

    def prune(self, now_ns: int) -> None:
        self.leases.prune(now_ns)
