"""The decode role on the shared engine host: continue a request from prompt +
first token, loading the prompt's KV from where the prefill's handle says
(``do_remote_prefill``: only the blocks past what this engine's own prefix cache
holds, so a conversation's next turn loads its new blocks alone), or computing it
here when no handle came (the aggregated fallback). Pushed KV is taken from the
connector's inbox by the connector itself; nothing here holds KV past the request."""

from __future__ import annotations

from pdserve.core.types import PhaseRequest, Role
from pdserve.worker.engine import EngineParams
from pdserve.worker.policy import RolePolicy


class DecodePolicy(RolePolicy):
    """Holds nothing past a request and runs nothing beside the engine: every other
    method is ``RolePolicy``'s default."""

    @property
    def role(self) -> Role:
        return "decode"

    def engine_params(self, request: PhaseRequest) -> EngineParams:
        handle = request.kv_handle
        params = None if handle is None else dict(handle.to_params(), do_remote_prefill=True)
        # Prompt logprobs only where the prompt is computed here: with a handle, prefill
        # returned them (and asking would make vLLM skip the loaded KV).
        return EngineParams(
            max_tokens=request.sampling.max_tokens, kv_transfer_params=params,
            num_output_in_prompt=request.num_output_in_prompt,
            prompt_logprobs=request.sampling.prompt_logprobs if handle is None else None)
