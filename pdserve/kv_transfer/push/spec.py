"""What a prefill step pushes (layer-wise push), as a plain value: importable
without vLLM, so the push planner and sender load where vLLM is absent."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.core.handle import PushTarget


@dataclass(frozen=True)
class PushSpec:
    """Prefill, one step: after each layer is computed, send the blocks at
    positions ``first_position …`` (``block_ids``) of a request's
    ``num_blocks``-block prompt to ``target``. ``final``: this step computes
    the prompt's last tokens (earlier steps may leave their last block partial)."""

    target: PushTarget
    first_position: int
    block_ids: tuple[int, ...]
    num_blocks: int
    final: bool
