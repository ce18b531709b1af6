"""The LoRA adapters a router brings every worker to (``LoraTargets``): those it loaded
through ``POST /v1/load_lora_adapter`` and those it unloaded. A worker that joins later
(or restarts, or missed a load) gets them replayed after its next health check, in
the background (a load takes seconds; a probe waits for none): placement reads what a
worker's Health says it serves, so an adapter's requests reach it once it took it."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import WorkerHealth
from pdserve.router.dispatch.workers.client import WorkerCallError

logger = logging.getLogger("pdserve.router.workers")

# Loading an adapter reads its folder into the engine: seconds, not a probe's deadline.
LORA_CALL_TIMEOUT_S = 60.0
# A worker's answer to a LoRA call when it was started without --enable-lora.
FAILED_PRECONDITION = "FAILED_PRECONDITION"


class LoraCalls(Protocol):
    """The worker calls a replay makes (``WorkerClient``); they raise on failure."""

    async def load_lora(self, adapter: LoraAdapter, timeout_s: float) -> bool: ...

    async def unload_lora(self, name: str, timeout_s: float) -> bool: ...


class LoraTargets:
    """Adapters loaded (by name) and unloaded through this router, latest call wins."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoraAdapter] = {}
        self.unloaded: set[str] = set()
        # Held by the admin plane's load/unload (target, then fan-out) and by each replay:
        # a replay never runs against a target that is being changed.
        self.lock = asyncio.Lock()

    def snapshot(self) -> tuple[dict[str, LoraAdapter], set[str]]:
        return dict(self.loaded), set(self.unloaded)

    def restore(self, snapshot: tuple[dict[str, LoraAdapter], set[str]]) -> None:
        """Back to ``snapshot`` (a load or unload no worker took)."""
        self.loaded, self.unloaded = dict(snapshot[0]), set(snapshot[1])

    def on_loaded(self, adapter: LoraAdapter) -> None:
        self.loaded[adapter.name] = adapter
        self.unloaded.discard(adapter.name)

    def on_unloaded(self, name: str) -> None:
        self.loaded.pop(name, None)
        self.unloaded.add(name)

    def changes(self, served: tuple[LoraAdapter, ...]
                ) -> tuple[list[LoraAdapter], list[str]]:
        """What a worker serving ``served`` must load and unload to match."""
        have = {a.name: a for a in served}
        to_load = [a for name, a in self.loaded.items() if have.get(name) != a]
        return to_load, [name for name in self.unloaded if name in have]

    def needs_replay(self, health: WorkerHealth) -> bool:
        return health.ready and any(self.changes(health.loras))

    async def replay(self, calls: LoraCalls, health: WorkerHealth) -> ReplayResult:
        """Bring a ready worker to the targets (off any probe's deadline: the worker's
        background task). A call that fails is tried again after the next check (the
        worker serves without it); a worker with LoRA off (FAILED_PRECONDITION) is left
        alone."""
        async with self.lock:
            return await self._replay(calls, health)

    async def _replay(self, calls: LoraCalls, health: WorkerHealth) -> ReplayResult:
        to_load, to_unload = self.changes(health.loras)
        changed = False
        for adapter in to_load:
            try:
                await calls.load_lora(adapter, LORA_CALL_TIMEOUT_S)
                changed = True
            except Exception as exc:  # noqa: BLE001 - one adapter must not fail the rest
                if isinstance(exc, WorkerCallError) and exc.code == FAILED_PRECONDITION:
                    return ReplayResult(changed, lora_off=True)
                logger.info("worker %s: LoRA %s not loaded (%s)", health.worker_id,
                            adapter.name, exc)
        for name in to_unload:
            try:
                await calls.unload_lora(name, LORA_CALL_TIMEOUT_S)
                changed = True
            except Exception as exc:  # noqa: BLE001
                logger.info("worker %s: LoRA %s not unloaded (%s)", health.worker_id, name,
                            exc)
        return ReplayResult(changed, lora_off=False)


@dataclass(frozen=True)
class ReplayResult:
    """``changed``: some call took (its health is worth reading again); ``lora_off``:
    the worker serves no adapters (started without --enable-lora)."""

    changed: bool
    lora_off: bool
