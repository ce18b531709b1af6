"""The LoRA adapters a router serves (``LoraCatalog``): what the workers report serving
and what it loaded itself (``workers/loras.py``). It answers which ``model`` names an
adapter (the rest are 404 ``model_not_found``), which folder an adapter runs from (its
cache salt, ``core.lora.adapter_salt``), and fans the admin plane's load and unload out
to every worker.

A load is kept (and replayed on workers that join later) once a worker took it; one no
worker took is an error and not kept: ``LoraRefusedError`` when they refused the folder
(400), ``LoraNotLoadedError`` otherwise (no worker, LoRA off, unreachable: 503).
An unload is kept always: a worker that starts with the
adapter (``--lora-modules``) is brought back to the router's word.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import SamplingSpec
from pdserve.router.dispatch.workers.client import WorkerCallError
from pdserve.router.dispatch.workers.loras import LORA_CALL_TIMEOUT_S
from pdserve.router.dispatch.workers.pool import Worker, WorkerPool

INVALID_ARGUMENT = "INVALID_ARGUMENT"


class LoraRefusedError(ValueError):
    """Every worker refused the adapter's folder (the message is the first's reason)."""


class LoraNotLoadedError(RuntimeError):
    """No worker took the load (none there, LoRA off on them, or unreachable)."""


@dataclass(frozen=True)
class LoraOutcome:
    """Per worker (its id): ``loaded``/``unchanged``/``unloaded``/``absent``, or the error."""

    workers: dict[str, str]

    @property
    def num_ok(self) -> int:
        return sum(1 for v in self.workers.values() if not v.startswith("error"))


class LoraCatalog:
    def __init__(self, pool: WorkerPool, base_model: str = "") -> None:
        self._pool = pool
        self.base_model = base_model

    def adapters(self) -> list[LoraAdapter]:
        """Every adapter served: the router's own, then those healthy workers report."""
        self._pool.lora_targets.follow()
        found = dict(self._pool.lora_targets.loaded)
        gone = self._pool.lora_targets.unloaded
        for worker in self._pool.all:
            state = worker.snapshot()
            if state.healthy:
                for adapter in (a for a in state.loras if a.name not in gone):
                    found.setdefault(adapter.name, adapter)
        return sorted(found.values(), key=lambda a: a.name)

    def adapter(self, name: str | None) -> LoraAdapter | None:
        """The adapter a request for ``name`` runs, fixed when it arrives (None: not an
        adapter this router serves): the router's target once a worker serves it; during
        a refit's fan-out, the folder workers still serve (a request runs one folder
        whole, never the new one before any worker has it)."""
        if name is None:
            return None
        targets = self._pool.lora_targets
        targets.follow()
        own = targets.loaded.get(name)
        if own is None and name in targets.unloaded:
            return None  # unloaded (or being unloaded) through this router: route none
        served = [a for w in self._pool.all for a in _served(w) if a.name == name]
        if own is not None and (own in served or not served):
            return own
        return served[0] if served else None

    async def load(self, adapter: LoraAdapter) -> LoraOutcome:
        """Load ``adapter`` on every worker; ``LoraRefusedError`` when each refused it,
        ``LoraNotLoadedError`` when none took it otherwise. The target is set before the
        fan-out, under the lock replays take: a worker's replay meanwhile brings it to
        this adapter, never back to the one it replaces."""
        targets = self._pool.lora_targets
        async with targets.lock:
            targets.follow()
            before = targets.snapshot()
            targets.on_loaded(adapter)
            workers = self._pool.all
            results = await asyncio.gather(*(_load(w, adapter) for w in workers))
            outcome = LoraOutcome({_name(w): r for w, r in zip(workers, results, strict=True)})
            if outcome.num_ok == 0:
                targets.restore(before)
                refused = [r for r in results if r.startswith(f"error: {INVALID_ARGUMENT}")]
                if refused:
                    raise LoraRefusedError(refused[0].split(": ", 2)[-1])
                raise LoraNotLoadedError(f"no worker loaded LoRA {adapter.name!r}: "
                                         f"{'; '.join(results) or 'no workers'}")
        await self._refresh(workers)
        return outcome

    async def unload(self, name: str) -> LoraOutcome:
        """Unload ``name`` everywhere; ``KeyError`` when no worker (and not the router)
        served it. New requests for it are refused (404) before the fan-out; each worker
        lets those running under it finish (``worker/lora.LORA_DRAIN_S``) first."""
        targets = self._pool.lora_targets
        async with targets.lock:
            known = self.adapter(name) is not None  # (follows the other processes)
            before = targets.snapshot()
            targets.on_unloaded(name)
            workers = self._pool.all
            results = await asyncio.gather(*(_unload(w, name) for w in workers))
            if not known and "unloaded" not in results:
                targets.restore(before)
                raise KeyError(name)
        await self._refresh(workers)
        return LoraOutcome({_name(w): r for w, r in zip(workers, results, strict=True)})

    @staticmethod
    async def _refresh(workers: list[Worker]) -> None:
        """Their health again: what they serve now is what placement reads."""
        await asyncio.gather(*(w.refresh(LORA_CALL_TIMEOUT_S) for w in workers))

    def serves(self, adapter: LoraAdapter) -> bool:
        """A healthy worker serves ``adapter`` (that name from that folder)."""
        return any(adapter in _served(w) for w in self._pool.all)


def _served(worker: Worker) -> tuple[LoraAdapter, ...]:
    state = worker.snapshot()
    return state.loras if state.healthy else ()


def _name(worker: Worker) -> str:
    return worker.snapshot().worker_id or worker.member_id


async def _load(worker: Worker, adapter: LoraAdapter) -> str:
    try:
        changed = await worker.client.load_lora(adapter, LORA_CALL_TIMEOUT_S)
    except WorkerCallError as exc:
        return f"error: {exc.code}: {exc.details}"
    return "loaded" if changed else "unchanged"


async def _unload(worker: Worker, name: str) -> str:
    try:
        unloaded = await worker.client.unload_lora(name, LORA_CALL_TIMEOUT_S)
    except WorkerCallError as exc:
        return f"error: {exc.code}: {exc.details}"
    return "unloaded" if unloaded else "absent"


def refit_folder(sampling: SamplingSpec, catalog: LoraCatalog) -> SamplingSpec:
    """The adapter folder a request runs on its next attempt through the weight gate.
    Unchanged while a worker serves the folder it arrived under (exact identity, as
    placement wants it) or the adapter is served from no folder (it fails as before).
    When a refit moved the name to another folder meanwhile and no worker serves the old
    one (vLLM's ``/pause``, ``load_lora_adapter``, ``/resume`` while it waited at the
    gate, or was kept): the new folder. A request none of whose tokens went out runs on
    it unseen (as one a weight update ended before any output); a kept one goes on under
    it from the tokens sent, and its response's spans say where the folder changed
    (``lora_tag`` on the chunks)."""
    if sampling.lora_name is None or sampling.lora_path is None:
        return sampling
    served = catalog.adapter(sampling.lora_name)
    if (served is None or served.path == sampling.lora_path
            or catalog.serves(LoraAdapter(sampling.lora_name, sampling.lora_path))):
        return sampling
    return replace(sampling, lora_path=served.path)


def lora_tag(sampling: SamplingSpec) -> str | None:
    """The tag of the adapter folder a request runs (None: the base model)."""
    if sampling.lora_name is None or sampling.lora_path is None:
        return None
    return LoraAdapter(sampling.lora_name, sampling.lora_path).tag
