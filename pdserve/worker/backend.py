"""What the gRPC servicer serves: a ``WorkerBackend``. ``EngineHost`` (over vLLM's
engine or the simulated one) and the router tests' scripted worker implement it, so
both speak through the same servicer (``pdserve.worker.servicer``). Its weights
(``WeightsBackend``) and LoRA adapters (``LoraBackend``) are part of it: a backend
that cannot change them raises ``WorkerError("unimplemented")``.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Literal, Protocol

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import (
    PhaseOutput,
    PhaseRequest,
    Role,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.core.weight_calls import WeightCall

if TYPE_CHECKING:
    from pdserve.worker.kv.mirror import KvCacheMirror

ErrorKind = Literal[
    "invalid_argument", "failed_precondition", "unavailable", "unimplemented", "internal",
    "aborted"]


class WorkerError(Exception):
    """A request the backend refuses or cannot finish. ``kind`` says which gRPC
    status the servicer answers with; the message goes to the caller as is."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind: ErrorKind = kind


class WeightsBackend(Protocol):
    """A worker's weights, changed in place (``pdserve.worker.weights``). Errors:
    ``ValueError`` for a checkpoint that cannot be the model's weights, ``WorkerError``
    otherwise (``unimplemented`` where the weights cannot change)."""

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        """Read ``model_path`` for a commit as ``version``; the worker serves on meanwhile."""
        ...

    async def commit_weights(self, version: str) -> None:
        """Serve the staged ``version``. The servicer calls it only once nothing is in
        flight (``ServingState.commit_weights`` drains first)."""
        ...

    async def discard_weights(self) -> bool:
        """Drop what is staged; whether anything was."""
        ...

    async def engine_weight_call(self, call: WeightCall) -> str:
        """Run one of vLLM's weight-transfer calls; the version served after it."""
        ...


class LoraBackend(Protocol):
    """A worker's LoRA adapters (``pdserve.worker.lora.adapters``). Errors: ``ValueError`` for a
    folder the engine cannot load, ``WorkerError`` otherwise (``unimplemented`` where it
    serves none)."""

    async def load_lora(self, adapter: LoraAdapter) -> bool:
        """Serve ``adapter``; False: it was served from that folder already."""
        ...

    async def unload_lora(self, name: str) -> bool:
        """Stop serving ``name``; False: it was not served."""
        ...


class WorkerBackend(WeightsBackend, LoraBackend, Protocol):
    """One worker's logic behind the servicer, free of protobuf and gRPC.

    The servicer checks a ``Generate`` against ``health()`` (ready, role,
    ``max_model_len``) before it calls ``generate``, so a backend sees only
    requests for its own phase. Errors: raise ``WorkerError`` (its kind picks the
    status) or ``ValueError`` (invalid argument); anything else is internal.
    Everything runs on the server's event loop.
    """

    def generate(self, request: PhaseRequest) -> AsyncGenerator[PhaseOutput, None]:
        """The phase's outputs in order; the last one has a ``finish_reason``.
        The servicer closes the iterator when the caller cancels the call."""
        ...

    async def abort(self, request_id: str) -> bool:
        """Stop ``request_id`` and free what this worker holds for it (its KV
        lease included); True if there was anything."""
        ...

    def health(self) -> WorkerHealth:
        """Who this worker is and whether it serves yet."""
        ...

    async def load(self) -> WorkerLoadReport:
        """Current load and cumulative counters (may prune expired leases)."""
        ...

    def kv_mirror(self) -> KvCacheMirror | None:
        """The prefix-cache mirror its KV events come from; None when this worker
        publishes none. Raises ``WorkerError("unavailable")`` while it cannot say yet."""
        ...

    def set_role(self, role: Role) -> None:
        """Serve ``role`` from now on with the same engine. The servicer calls it only
        once nothing is in flight and no KV lease is held (``ServingState.switch_role``
        drains first). Raises ``WorkerError("unimplemented")`` where the role is fixed."""
        ...

    async def end_role_work(self) -> tuple[int, int]:
        """A role switch's drain ran out: abort every request in flight (a decode's
        stream ends ``abort``; the router continues it on another worker) and release
        every KV lease; (requests aborted, leases released)."""
        ...
