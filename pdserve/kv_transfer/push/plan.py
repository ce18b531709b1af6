"""Scheduler side of layer-wise push (prefill): which blocks each step computes.

A prefill request whose ``kv_transfer_params`` carry ``push`` (a decode's KV
endpoint and a transfer id, chosen by the router) has its blocks sent to that
decode while its forward pass runs: after each layer, the worker side sends
the blocks this step wrote. This class only works out those blocks from the
``SchedulerOutput``; nothing here touches the network.

Positions, not block ids, address pushed blocks: position ``i`` is the prompt's
``i``-th block. A step with prefix-cache hits also pushes the hit blocks (the
decode needs the whole prompt); a later chunk of a chunked prefill re-sends
the block its predecessor left partial.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pdserve.core.handle import PushTarget
from pdserve.kv_transfer.push.spec import PushSpec

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class _PushState:
    target: PushTarget
    num_tokens: int
    num_blocks: int
    block_ids: list[int] = field(default_factory=list)

    def spec(self, first_position: int, end_token: int, block_size: int) -> PushSpec | None:
        last = min(-(-end_token // block_size), self.num_blocks, len(self.block_ids))
        if last <= first_position:
            return None
        return PushSpec(
            self.target, first_position, tuple(self.block_ids[first_position:last]),
            self.num_blocks, final=end_token >= self.num_tokens,
        )


def push_target_of(params: dict[str, Any] | None) -> PushTarget | None:
    """The push target of a prefill request's ``kv_transfer_params``, if any."""
    if not params or not params.get("do_remote_decode") or not params.get("push"):
        return None
    return PushTarget.from_params(params["push"])


class PushPlanner:
    def __init__(self, block_size: int) -> None:
        self._block_size = block_size
        self._reqs: dict[str, _PushState] = {}

    @property
    def num_tracked(self) -> int:
        return len(self._reqs)

    def plan(self, so: SchedulerOutput) -> dict[str, PushSpec]:
        specs: dict[str, PushSpec] = {}
        for new in so.scheduled_new_reqs:
            extra = new.sampling_params.extra_args if new.sampling_params else None
            target = push_target_of((extra or {}).get("kv_transfer_params"))
            if target is None or new.prompt_token_ids is None:
                continue
            num_tokens = len(new.prompt_token_ids)
            pushed = _PushState(
                target, num_tokens, -(-num_tokens // self._block_size), list(new.block_ids[0])
            )
            self._reqs[new.req_id] = pushed
            end = new.num_computed_tokens + so.num_scheduled_tokens.get(new.req_id, 0)
            self._add(specs, new.req_id, pushed.spec(0, end, self._block_size))
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self._reqs.get(req_id)
            if state is None:
                continue
            new_ids = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            first = computed // self._block_size
            if req_id in cached.resumed_req_ids:  # preempted: a fresh block list
                state.block_ids = list(new_ids[0]) if new_ids else []
                first = 0
            elif new_ids:
                state.block_ids.extend(new_ids[0])
            end = computed + so.num_scheduled_tokens.get(req_id, 0)
            self._add(specs, req_id, state.spec(first, end, self._block_size))
        return specs

    def forget(self, req_id: str) -> PushTarget | None:
        """Stop tracking a finished request; its push target if it was pushed."""
        state = self._reqs.pop(req_id, None)
        return state.target if state is not None else None

    @staticmethod
    def _add(specs: dict[str, PushSpec], req_id: str, spec: PushSpec | None) -> None:
        if spec is not None:
            specs[req_id] = spec
