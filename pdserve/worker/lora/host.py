"""A worker's LoRA adapters in its engine (``EngineHost``'s part, ``adapters.py`` says what
an adapter is to a worker): the adapters it starts with loaded before it serves, then
loads and unloads one at a time (a replay and an admin load may cross); a refit's old
folder and an unloaded adapter leave the engine only once the requests running under
them ended (``LoraRuns``, up to ``drain_s``, then aborted: the router continues them)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pdserve.core.lora import LoraAdapter, LoraConfig
from pdserve.worker.engine import Engine
from pdserve.worker.lora.adapters import LORA_DRAIN_S, LoadedLora, LoraRuns, LoraTable

logger = logging.getLogger("pdserve.worker")


class LoraHost:
    """``engine()``: the running engine (raises while there is none); ``abort(id)``: end
    a request on this worker; ``changed()``: what the worker serves changed (its Health
    is described again)."""

    def __init__(self, config: LoraConfig, worker_id: str, engine: Callable[[], Engine],
                 abort: Callable[[str], Awaitable[bool]], changed: Callable[[], None]) -> None:
        self.table = LoraTable(config)
        self.runs = LoraRuns()  # what an unload waits for
        self.drain_s = LORA_DRAIN_S
        self._worker_id = worker_id
        self._engine, self._abort, self._changed = engine, abort, changed
        self._lock = asyncio.Lock()  # one load or unload at a time

    async def start(self) -> None:
        """Load the adapters it starts with (``--lora-modules``) into the engine now, as
        ``vllm serve`` does: a folder the engine refuses fails the start (``ValueError``)."""
        engine = self._engine()
        for loaded in self.table.served:
            await engine.add_lora(loaded)

    async def load(self, adapter: LoraAdapter) -> bool:
        """Serve ``adapter`` (loaded into the engine now); False: served already."""
        async with self._lock:
            engine = self._engine()
            loaded = self.table.to_load(adapter)
            if loaded is None:
                return False
            await engine.add_lora(loaded)
            previous = self.table.loaded(loaded)
            if previous is not None:  # a refit: the old adapter leaves the engine, drained
                await self._drain(previous)
                await engine.remove_lora(previous.lora_id)
            self._changed()
            logger.info("worker %s serves LoRA %s from %s", self._worker_id, adapter.name,
                        adapter.path)
            return True

    async def unload(self, name: str) -> bool:
        """Stop serving ``name``; False: it was not served."""
        async with self._lock:
            engine = self._engine()
            removed = self.table.remove(name)  # new requests for it are refused from now
            if removed is None:
                return False
            await self._drain(removed)
            await engine.remove_lora(removed.lora_id)
            self._changed()
            logger.info("worker %s no longer serves LoRA %s", self._worker_id, name)
            return True

    async def _drain(self, leaving: LoadedLora) -> None:
        """Let the requests running under ``leaving`` end (up to ``drain_s``), then abort
        the rest: they end ``abort`` and the router continues them elsewhere."""
        left = await self.runs.drain(leaving.lora_id, self.drain_s)
        for request_id in left:
            logger.warning("LoRA %s leaves: request %s still ran after %.0f s; aborted",
                           leaving.adapter.name, request_id, self.drain_s)
            await self._abort(request_id)
