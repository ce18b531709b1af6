"""The LoRA adapters a router brings every worker to (``LoraTargets``): those it loaded
through ``POST /v1/load_lora_adapter`` and those it unloaded. A worker that joins later
(or restarts, or missed a load) gets them replayed at its next health check, before
that check is adopted: it is placed on only once it serves what the router loaded."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Protocol

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import WorkerHealth

logger = logging.getLogger("pdserve.router.workers")

# Loading an adapter reads its folder into the engine: seconds, not a probe's deadline.
LORA_CALL_TIMEOUT_S = 60.0


class LoraCalls(Protocol):
    """The worker calls a replay makes (``WorkerClient``); they raise on failure."""

    async def load_lora(self, adapter: LoraAdapter, timeout_s: float) -> bool: ...

    async def unload_lora(self, name: str, timeout_s: float) -> bool: ...


class LoraTargets:
    """Adapters loaded (by name) and unloaded through this router, latest call wins."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoraAdapter] = {}
        self.unloaded: set[str] = set()

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

    async def replay(self, calls: LoraCalls, health: WorkerHealth) -> WorkerHealth:
        """Bring a ready worker to the targets; its health as it serves after. A call
        that fails is tried again at the next check (the worker serves without it)."""
        if not health.ready:
            return health
        to_load, to_unload = self.changes(health.loras)
        if not to_load and not to_unload:
            return health
        served = {a.name: a for a in health.loras}
        for adapter in to_load:
            try:
                await calls.load_lora(adapter, LORA_CALL_TIMEOUT_S)
                served[adapter.name] = adapter
            except Exception as exc:  # noqa: BLE001 - one adapter must not fail the check
                logger.info("worker %s: LoRA %s not loaded (%s)", health.worker_id,
                            adapter.name, exc)
        for name in to_unload:
            try:
                await calls.unload_lora(name, LORA_CALL_TIMEOUT_S)
                served.pop(name, None)
            except Exception as exc:  # noqa: BLE001
                logger.info("worker %s: LoRA %s not unloaded (%s)", health.worker_id, name,
                            exc)
        return replace(health, loras=tuple(served.values()))
