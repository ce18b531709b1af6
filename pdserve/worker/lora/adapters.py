"""A worker's LoRA adapters, the host's side: which adapters it serves under which name,
the engine's id for each, and how a request under one runs.

- A request names its adapter (``SamplingSpec.lora_name``, and its folder, ``lora_path``:
  a worker serving the name from another folder refuses it ABORTED, so the router runs
  it elsewhere); the worker runs it with the adapter it serves under that name
  (vLLM's ``LoRARequest``: name, id, folder) on whichever
  phase it computes, so prefill and decode run the same one.
- Its KV is cached under ``core.lora.adapter_salt`` (the adapter's name and folder),
  before the weight version joins the salt (``weights.py``): no block computed under
  the base model or another adapter ever matches it.
- Adapters given at start (``--lora-modules``) are loaded before the worker serves
  (``EngineHost.start_loras``); a bad folder fails its start, as in ``vllm serve``.
  ``load`` loads at once (a bad folder fails the call); a new folder
  under a served name replaces the adapter under a fresh engine id.
- An unload (and a refit's removal of the old adapter) drains: new requests go to the
  new adapter (or are refused), those running under the old one finish (``LoraRuns``,
  up to ``LORA_DRAIN_S``, then they are aborted) before the engine drops it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, replace

from pdserve.core.lora import LoraAdapter, LoraConfig, adapter_salt
from pdserve.core.types import PhaseRequest
from pdserve.worker.backend import WorkerError


@dataclass(frozen=True)
class LoadedLora:
    """An adapter as the engine knows it: vLLM's ``lora_int_id`` (> 0, unique per
    engine; a replaced adapter gets a new one)."""

    adapter: LoraAdapter
    lora_id: int


class LoraTable:
    """The adapters served, by name."""

    def __init__(self, config: LoraConfig) -> None:
        self.enabled = config.enable_lora
        self._ids = itertools.count(1)
        self._served: dict[str, LoadedLora] = {}
        for module in config.modules:
            self._served[module.name] = LoadedLora(module, next(self._ids))

    @property
    def adapters(self) -> tuple[LoraAdapter, ...]:
        return tuple(loaded.adapter for loaded in self._served.values())

    @property
    def served(self) -> tuple[LoadedLora, ...]:
        return tuple(self._served.values())

    def request(self, request: PhaseRequest) -> tuple[PhaseRequest, LoadedLora | None]:
        """``request`` with its cache salt joined to its adapter, and that adapter (None:
        the base model). An adapter this worker does not serve is INVALID_ARGUMENT."""
        name = request.sampling.lora_name
        if name is None:
            return request, None
        loaded = self._served.get(name)
        if loaded is None:
            raise WorkerError("invalid_argument", f"this worker serves no LoRA adapter "
                              f"{name!r} (serves: {', '.join(self._served) or 'none'})")
        wanted = request.sampling.lora_path
        if wanted is not None and wanted != loaded.adapter.path:
            # Another folder under that name (a refit half done, a worker on the old one):
            # running it would compute other weights' KV. The router runs it elsewhere.
            raise WorkerError("aborted", f"this worker serves LoRA {name!r} from another "
                              f"folder than {wanted!r}; run it on another worker")
        salt = adapter_salt(request.sampling.cache_salt, loaded.adapter)
        return replace(request, sampling=replace(request.sampling, cache_salt=salt)), loaded

    def check_enabled(self) -> None:
        if not self.enabled:
            raise WorkerError("failed_precondition",
                              "LoRA is off on this worker (start it with --enable-lora)")

    def to_load(self, adapter: LoraAdapter) -> LoadedLora | None:
        """The engine's adapter for ``adapter`` (a fresh id), or None when it is served
        from that folder already."""
        self.check_enabled()
        current = self._served.get(adapter.name)
        if current is not None and current.adapter == adapter:
            return None
        return LoadedLora(adapter, next(self._ids))

    def loaded(self, loaded: LoadedLora) -> LoadedLora | None:
        """``loaded`` is served now; the adapter it replaced (None: none)."""
        previous = self._served.get(loaded.adapter.name)
        self._served[loaded.adapter.name] = loaded
        return previous

    def remove(self, name: str) -> LoadedLora | None:
        self.check_enabled()
        return self._served.pop(name, None)


# How long an unload (or a refit's removal of the old adapter) waits for the requests
# running under it before it aborts them: the engine must not reload a removed adapter
# from its folder for a request still running (vLLM does) nor cut a stream short.
LORA_DRAIN_S = 30.0
_DRAIN_POLL_S = 0.02


class LoraRuns:
    """The requests running under each engine adapter (by ``lora_int_id``)."""

    def __init__(self) -> None:
        self._by_request: dict[str, int] = {}

    def started(self, request_id: str, lora: LoadedLora | None) -> None:
        if lora is not None:
            self._by_request[request_id] = lora.lora_id

    def ended(self, request_id: str) -> None:
        self._by_request.pop(request_id, None)

    def running(self, lora_id: int) -> list[str]:
        return [rid for rid, lid in self._by_request.items() if lid == lora_id]

    async def drain(self, lora_id: int, timeout_s: float = LORA_DRAIN_S) -> list[str]:
        """Wait up to ``timeout_s`` for the requests under ``lora_id`` to end; those
        still running then (the caller aborts them)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.running(lora_id)) and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        return left
