"""vLLM's ``AsyncLLM`` behind the ``Engine`` contract: the only worker module
that builds vLLM request objects. vLLM is imported lazily (slow to import; the
connector module is loaded in every engine process)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.types import SamplingSpec
from pdserve.worker.engine import (
    EngineConfig,
    EngineCounters,
    EngineParams,
    EngineStep,
    build_engine,
)

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM


def to_sampling_params(sampling: SamplingSpec, params: EngineParams) -> SamplingParams:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        extra_args=({"kv_transfer_params": params.kv_transfer_params}
                    if params.kv_transfer_params else None),
    )


def _phase_ns(stats: Any) -> dict[str, int]:
    """``queue_ns``/``compute_ns`` from vLLM's ``RequestStateStats`` (EngineCore's monotonic
    stamps; present because the engine logs stats for its counters). A stamp vLLM did not
    set is 0: its interval is then not reported."""
    queued = getattr(stats, "queued_ts", 0.0)
    scheduled = getattr(stats, "scheduled_ts", 0.0)
    first = getattr(stats, "first_token_ts", 0.0)
    return {"queue_ns": _interval_ns(queued, scheduled),
            "compute_ns": _interval_ns(scheduled, first)}


def _interval_ns(start: float, end: float) -> int:
    return int((end - start) * 1e9) if 0.0 < start <= end else 0


class VllmEngine:
    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm

    @classmethod
    def start(cls, config: EngineConfig, counters: EngineCounters) -> VllmEngine:
        """Start vLLM (blocks ~20-40 s on CPU)."""
        return cls(build_engine(config, counters))

    @property
    def block_size(self) -> int:
        return self._llm.vllm_config.cache_config.block_size or 0

    @property
    def dtype(self) -> str:
        return str(self._llm.vllm_config.model_config.dtype).removeprefix("torch.")

    @property
    def num_kv_blocks(self) -> int:
        return self._llm.vllm_config.cache_config.num_gpu_blocks or 0

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingSpec, params: EngineParams
                       ) -> AsyncGenerator[EngineStep, None]:
        from vllm.inputs import TokensPrompt

        stream = self._llm.generate(TokensPrompt(prompt_token_ids=list(prompt_token_ids)),
                                    to_sampling_params(sampling, params), request_id)
        # Closing vLLM's stream (our caller went away) aborts the request in the engine.
        async with contextlib.aclosing(stream):
            async for out in stream:
                completion = out.outputs[0]
                yield EngineStep(
                    token_ids=tuple(completion.token_ids), finished=out.finished,
                    finish_reason=completion.finish_reason,
                    kv_transfer_params=out.kv_transfer_params,
                    num_cached_tokens=out.num_cached_tokens or 0,
                    **(_phase_ns(out.metrics) if out.finished else {}))

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        self._llm.shutdown()
