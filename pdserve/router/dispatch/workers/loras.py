"""The LoRA adapters a router brings every worker to (``LoraTargets``): those it loaded
through ``POST /v1/load_lora_adapter`` and those it unloaded. A worker that joins later
(or restarts, or missed a load) gets them replayed after its next health check, in
the background (a load takes seconds; a probe waits for none): placement reads what a
worker's Health says it serves, so an adapter's requests reach it once it took it.

The processes of ``--processes N`` share their targets (``share``: the weight board's
LoRA section): a load or unload through any of them is every process's, so each one
replays it on workers that join and routes by it (an adapter unloaded through one is
never brought back by another)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

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


class SharedTargets(Protocol):
    """Where the router's processes keep their common targets (``WeightBoard``)."""

    @property
    def lora_epoch(self) -> int: ...

    def loras(self) -> dict[str, Any]: ...

    def change_loras(self, change: Callable[[dict[str, Any]], None]) -> None: ...


Snapshot = tuple[dict[str, LoraAdapter], set[str]]


class LoraTargets:
    """Adapters loaded (by name) and unloaded through this router, latest call wins."""

    def __init__(self) -> None:
        self.loaded: dict[str, LoraAdapter] = {}
        self.unloaded: set[str] = set()
        # Held by the admin plane's load/unload (target, then fan-out) and by each replay:
        # a replay never runs against a target that is being changed (in this process).
        self.lock = asyncio.Lock()
        self._shared: SharedTargets | None = None
        self._epoch = -1

    def share(self, shared: SharedTargets) -> None:
        """Keep the targets in ``shared`` with the router's other processes."""
        self._shared = shared
        self.follow()

    def follow(self) -> None:
        """Adopt what any process changed since the last look (one word read when
        nothing did)."""
        if self._shared is None or self._shared.lora_epoch == self._epoch:
            return
        self._epoch = self._shared.lora_epoch
        raw = self._shared.loras()
        self.loaded = {name: LoraAdapter(name, path)
                       for name, path in raw.get("loaded", {}).items()}
        self.unloaded = set(raw.get("unloaded", ()))

    def snapshot(self) -> Snapshot:
        return dict(self.loaded), set(self.unloaded)

    def restore(self, snapshot: Snapshot) -> None:
        """Back to ``snapshot`` (a load or unload no worker took): each name it changed."""
        names = {*self.loaded, *self.unloaded, *snapshot[0], *snapshot[1]}
        changed = [n for n in names if (self.loaded.get(n), n in self.unloaded)
                   != (snapshot[0].get(n), n in snapshot[1])]
        for name in changed:
            self._publish(name, snapshot[0].get(name), name in snapshot[1])
        self.loaded, self.unloaded = dict(snapshot[0]), set(snapshot[1])

    def on_loaded(self, adapter: LoraAdapter) -> None:
        """``ValueError`` (nothing changed) when the shared targets have no room."""
        self._publish(adapter.name, adapter, False)
        self.loaded[adapter.name] = adapter
        self.unloaded.discard(adapter.name)

    def on_unloaded(self, name: str) -> None:
        self._publish(name, None, True)
        self.loaded.pop(name, None)
        self.unloaded.add(name)

    def _publish(self, name: str, adapter: LoraAdapter | None, gone: bool) -> None:
        """``name``'s target into the shared targets (the other names as they are there:
        another process may have changed them)."""
        if self._shared is None:
            return

        def change(raw: dict[str, Any]) -> None:
            loaded = raw.setdefault("loaded", {})
            unloaded = set(raw.get("unloaded", ()))
            loaded.pop(name, None)
            unloaded.discard(name)
            if adapter is not None:
                loaded[name] = adapter.path
            if gone:
                unloaded.add(name)
            raw["unloaded"] = sorted(unloaded)

        self._shared.change_loras(change)

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
