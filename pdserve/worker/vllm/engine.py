"""vLLM's ``AsyncLLM`` behind the ``Engine`` contract: the only worker module
that builds vLLM request objects. vLLM is imported lazily (slow to import; the
connector module is loaded in every engine process)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.core.types import SamplingSpec, StructuredOutput, TokenLogprobs, WeightsStaged
from pdserve.core.weight_calls import (
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    UpdateWeights,
    WeightCall,
    version_set_by,
)
from pdserve.worker.engine import (
    EngineConfig,
    EngineCounters,
    EngineParams,
    EngineStep,
    build_engine,
)
from pdserve.worker.engine_tmp import engine_folder
from pdserve.worker.kv.mirror import KvCacheMirror
from pdserve.worker.lora.adapters import LoadedLora
from pdserve.worker.vllm.kv_events import KvEventEndpoints, KvEventMirroring
from pdserve.worker.vllm.kv_status import ConnectorStatus
from pdserve.worker.vllm.weights_ext import check_checkpoint

logger = logging.getLogger("pdserve.worker")

if TYPE_CHECKING:
    from vllm import SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM


def to_sampling_params(sampling: SamplingSpec, params: EngineParams,
                       prompt_token_ids: Sequence[int] = ()) -> SamplingParams:
    """vLLM's parameters for one call. The last ``params.num_output_in_prompt`` prompt
    tokens are output already produced: ``min_tokens`` counts them, and they go in
    ``extra_args`` for the penalties (``output_in_prompt.py``) and the grammar (the
    connector's scheduler side)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from pdserve.worker.output_in_prompt import output_in_prompt_args

    extra: dict[str, Any] = output_in_prompt_args(prompt_token_ids,
                                                  params.num_output_in_prompt)
    if params.kv_transfer_params:
        extra["kv_transfer_params"] = params.kv_transfer_params
    return SamplingParams(
        max_tokens=params.max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k if sampling.top_k > 0 else 0,
        min_p=sampling.min_p,
        seed=sampling.seed,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty,
        # Within this call's budget (a prefill's is one token): vLLM refuses more.
        min_tokens=min(max(sampling.min_tokens - params.num_output_in_prompt, 0),
                       params.max_tokens),
        logit_bias=dict(sampling.logit_bias) or None,
        logprobs=sampling.logprobs,
        prompt_logprobs=params.prompt_logprobs,
        structured_outputs=_structured(sampling.structured),
        output_kind=RequestOutputKind.DELTA,
        # The router owns text (stop strings, logprob texts, tools): the engine's own
        # detokenizer would turn every token into text nobody reads, on the engine's core.
        detokenize=False,
        extra_args=extra or None,
    )


def _structured(spec: StructuredOutput | None) -> Any:
    if spec is None:
        return None
    import json

    from vllm.sampling_params import StructuredOutputsParams

    if spec.kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if spec.kind == "choice":
        return StructuredOutputsParams(choice=json.loads(spec.spec))
    if spec.kind == "json":
        return StructuredOutputsParams(json=spec.spec)
    if spec.kind == "regex":
        return StructuredOutputsParams(regex=spec.spec)
    if spec.kind == "grammar":
        return StructuredOutputsParams(grammar=spec.spec)
    return StructuredOutputsParams(structural_tag=spec.spec)


def _logprobs(token_ids: Sequence[int], positions: Any) -> tuple[TokenLogprobs, ...]:
    """vLLM's per-position ``{token id: Logprob}`` (None: nothing, the prompt's first)."""
    if not positions:
        return ()
    return tuple(TokenLogprobs(int(t), () if d is None else tuple(
        (int(i), float(lp.logprob), int(lp.rank)) for i, lp in d.items()))
        for t, d in zip(token_ids, positions, strict=False))


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


def _lora_request(lora: LoadedLora | None) -> Any:
    """vLLM's ``LoRARequest`` for ``lora`` (None: the base model)."""
    if lora is None:
        return None
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora.adapter.name, lora.lora_id, lora.adapter.path)


def _worker_error(exc: Exception) -> str:
    """The worker's own message out of vLLM's ``collective_rpc`` failure."""
    text = str(exc)
    marker = "Worker failed with error '"
    if marker in text:
        return text.split(marker, 1)[1].rsplit("', please check", 1)[0]
    return text


class VllmEngine:
    """``events``: where vLLM publishes its KV events (None: it publishes none);
    ``status``: its connector's counters."""

    def __init__(self, llm: AsyncLLM, status: ConnectorStatus,
                 events: KvEventEndpoints | None = None) -> None:
        self._llm = llm
        self._status = status
        self._events = events
        self._mirroring: KvEventMirroring | None = None

    @classmethod
    def start(cls, config: EngineConfig, counters: EngineCounters) -> VllmEngine:
        """Start vLLM (blocks ~20-40 s on CPU)."""
        events = None if config.kv_events is None else KvEventEndpoints.for_worker(
            config.kv_events, engine_folder())
        try:
            llm = build_engine(config, counters,
                               None if events is None else (events.pub, events.replay))
        except BaseException:
            if events is not None:  # a half-started engine may have bound them
                events.remove_files()
            raise
        return cls(llm, ConnectorStatus(config.connector), events)

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
        from vllm.exceptions import VLLMClientError
        from vllm.inputs import TokensPrompt

        prompt = TokensPrompt(prompt_token_ids=list(prompt_token_ids))
        if sampling.cache_salt is not None:
            prompt["cache_salt"] = sampling.cache_salt
        stream = self._llm.generate(prompt, to_sampling_params(sampling, params,
                                                               prompt_token_ids), request_id,
                                    lora_request=_lora_request(params.lora))
        # Closing vLLM's stream (our caller went away) aborts the request in the engine.
        async with contextlib.aclosing(stream):
            try:
                async for out in stream:
                    completion = out.outputs[0]
                    token_ids = tuple(completion.token_ids)
                    yield EngineStep(
                        token_ids=token_ids, finished=out.finished,
                        finish_reason=completion.finish_reason,
                        kv_transfer_params=out.kv_transfer_params,
                        num_cached_tokens=out.num_cached_tokens or 0,
                        logprobs=_logprobs(token_ids, completion.logprobs),
                        prompt_logprobs=_logprobs(prompt_token_ids, out.prompt_logprobs),
                        **(_phase_ns(out.metrics) if out.finished else {}))
            except VLLMClientError as exc:  # vLLM refused the request (a grammar it cannot
                raise ValueError(str(exc)) from exc  # compile, ...): INVALID_ARGUMENT

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    async def add_lora(self, lora: LoadedLora) -> None:
        try:
            await self._llm.add_lora(_lora_request(lora))
        except Exception as exc:  # noqa: BLE001 - vLLM wraps a bad folder in anything
            raise ValueError(f"cannot load LoRA adapter {lora.adapter.name!r} from "
                             f"{lora.adapter.path!r}: {_worker_error(exc)}") from None

    async def remove_lora(self, lora_id: int) -> None:
        await self._llm.remove_lora(lora_id)

    def mirror_kv_events(self, loop: asyncio.AbstractEventLoop) -> KvCacheMirror | None:
        if self._events is None:
            return None
        if self._mirroring is None:
            self._mirroring = KvEventMirroring.start(self._events, self.block_size, loop)
        return self._mirroring.mirror

    def kv_status(self) -> dict[str, Any]:
        return self._status.read()

    async def stage_weights(self, model_path: str, version: str) -> WeightsStaged:
        # Checked here first, from the files' headers: a bad folder is the caller's error
        # (INVALID_ARGUMENT), not an engine worker's failure.
        await asyncio.to_thread(check_checkpoint, model_path,
                                self._llm.vllm_config.model_config.model)
        started = time.monotonic_ns()
        try:
            replies = await self._llm.collective_rpc("pdserve_stage_weights",
                                                     args=(model_path, version))
        except Exception as exc:  # noqa: BLE001 - vLLM wraps the worker's error in Exception
            raise ValueError(_worker_error(exc)) from None
        return WeightsStaged(num_tensors=int(replies[0]["num_tensors"]),
                             num_bytes=sum(int(r["num_bytes"]) for r in replies),
                             stage_ns=time.monotonic_ns() - started)

    async def commit_weights(self, version: str) -> None:
        await self._llm.collective_rpc("pdserve_commit_weights", args=(version,))
        await self._after_update(version)

    async def discard_weights(self) -> bool:
        return any(await self._llm.collective_rpc("pdserve_discard_weights"))

    async def weight_call(self, call: WeightCall) -> str:
        """vLLM's own call, each by its own method."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        llm = self._llm
        if isinstance(call, InitWeightTransferEngine):
            await llm.init_weight_transfer_engine(
                WeightTransferInitRequest(init_info=call.init_info.vllm_dict()))
        elif isinstance(call, StartWeightUpdate):
            await llm.start_weight_update()
        elif isinstance(call, UpdateWeights):
            await llm.update_weights(
                WeightTransferUpdateRequest(update_info=call.update_info.vllm_dict()))
        elif isinstance(call, FinishWeightUpdate):
            await llm.collective_rpc("finish_weight_update")
        elif isinstance(call, ShutdownWeightTransferEngine):
            await llm.shutdown_weight_transfer_engine()
        version = version_set_by(call)
        if version is not None:
            await self._after_update(version)
        return await llm.get_weight_version()

    async def _after_update(self, version: str) -> None:
        """The new weights' version, and no KV of the old ones left to match: the
        prefix cache and the connector's tiers are emptied (False from vLLM: blocks were
        still held; the versioned salt keeps them from ever matching anyway)."""
        await self._llm.update_weight_version(version)
        if not await self._llm.reset_prefix_cache(reset_connector=True):
            logger.warning("prefix cache not fully reset after the update to %s", version)

    def shutdown(self) -> None:
        self._llm.shutdown()
        if self._mirroring is not None:
            self._mirroring.close()
            self._mirroring = None
        if self._events is not None:  # after the engine, which had bound them
            self._events.remove_files()
