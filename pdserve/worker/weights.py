"""A worker's weights, the host's side: which version the engine serves, what is staged
for the next one, and the rules that keep every call on one version.

- A call's tokens all come from one version: a commit happens only with no call in
  flight (``ServingState.commit_weights`` drains or aborts first), and the call's first
  output names the version (``PhaseOutput.weight_version``).
- KV crosses workers only within one version: a prefill stamps its handle with its
  version, and a decode on another version refuses the handle
  (``check_handle_version``); the version is part of the compatibility hash, so the
  routers never pair such workers in the first place.
- Cached KV is named per version: requests are cached under ``versioned_salt``, so
  blocks computed under other weights never match, in the engine's prefix cache, the
  KV tiers, the pool or the routers' index; the commit also empties the prefix cache
  and drops the tiers' entries (vLLM's ``reset_prefix_cache`` with the connector).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION, versioned_salt
from pdserve.core.handle import KVHandle
from pdserve.core.types import PhaseRequest
from pdserve.core.weight_calls import WEIGHT_CALLS
from pdserve.worker.backend import WorkerError

# vLLM's own weight-transfer calls a worker passes to its engine (``EngineWeightCall``,
# one typed message each), by the name of vLLM's HTTP route (and AsyncLLM method).
ENGINE_WEIGHT_CALLS = tuple(call.name for call in WEIGHT_CALLS)


@dataclass
class WeightsState:
    """The version served and the folder it came from ("": the model's own), and the
    (version, folder) staged for the next commit."""

    version: str = DEFAULT_WEIGHT_VERSION
    path: str = ""
    staged: tuple[str, str] | None = None

    def check_stage(self, model_path: str, version: str) -> None:
        if not version:
            raise ValueError("weight_version must not be empty")
        if not model_path:
            raise ValueError("model_path must not be empty")

    def check_commit(self, version: str) -> str:
        """The staged folder to commit as ``version``; raises when it is not staged."""
        if self.staged is None or self.staged[0] != version:
            held = "nothing" if self.staged is None else f"version {self.staged[0]!r}"
            raise WorkerError("failed_precondition",
                              f"cannot commit weights {version!r}: {held} is staged")
        return self.staged[1]

    def committed(self, version: str, path: str) -> None:
        self.version, self.path, self.staged = version, path, None

    def request(self, request: PhaseRequest) -> PhaseRequest:
        """``request`` as this version runs it: its KV handle checked, its cache salt
        joined to the version."""
        if request.weight_version and request.weight_version != self.version:
            raise WorkerError("failed_precondition",
                              f"the request was admitted under weights "
                              f"{request.weight_version!r}; this worker serves {self.version!r}")
        check_handle_version(request.kv_handle, self.version)
        salt = versioned_salt(request.sampling.cache_salt, self.version)
        if salt == request.sampling.cache_salt:
            return request
        return replace(request, sampling=replace(request.sampling, cache_salt=salt))


def check_handle_version(handle: KVHandle | None, version: str) -> None:
    """Refuse KV another version computed: continuing it would be a wrong answer that
    looks right (FAILED_PRECONDITION: the router does not retry it on the same pair)."""
    if handle is not None and handle.weight_version != version:
        raise WorkerError("failed_precondition",
                          f"the KV handle was computed under weights {handle.weight_version!r}; "
                          f"this worker serves {version!r}")


