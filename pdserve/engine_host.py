"""One phase of a request on the hosted engine: the logic behind a worker's
gRPC service, in plain Python (no gRPC types) so tests can drive it directly.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.engine import EngineConfig, EngineCounters, build_engine
from pdserve.kv_mirror import KvCacheMirror
from pdserve.kv_transfer.metadata import KVHandle, PushTarget
from pdserve.kv_transfer.push_plan import PUSH_TRANSPORTS
from pdserve.kv_transfer.wire import TransferError, request_once
from pdserve.router.types import SamplingSpec

if TYPE_CHECKING:
    from vllm.v1.engine.async_llm import AsyncLLM

logger = logging.getLogger("pdserve.worker")
_CONTROL_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class PhaseOutput:
    """Tokens since the previous output; the last one has ``finish_reason``."""

    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    kv_handle: KVHandle | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0


class EngineHost:
    def __init__(self, config: EngineConfig, worker_id: str) -> None:
        self.config = config
        self.worker_id = worker_id
        self.counters = EngineCounters()
        self.engine: AsyncLLM | None = None
        self._inflight: set[str] = set()
        # request id -> KV handle it holds on this (prefill) worker, until released.
        self._leases: dict[str, KVHandle] = {}
        # Prefill with KV events on: the engine's prefix-cached blocks, mirrored.
        self.kv_mirror: KvCacheMirror | None = None
        self._kv_source: Any = None

    @property
    def ready(self) -> bool:
        return self.engine is not None

    @property
    def kv_push(self) -> bool:
        """Whether this worker sends (prefill) or accepts (decode) layer-wise push."""
        cfg = self.config.connector
        return cfg.push and cfg.transport in PUSH_TRANSPORTS

    @property
    def num_inflight(self) -> int:
        return len(self._inflight)

    def start(self) -> None:
        """Load the engine (blocking; tens of seconds)."""
        self.engine = build_engine(self.config, self.counters)

    def start_kv_events(self, loop: asyncio.AbstractEventLoop) -> None:
        """Mirror the engine's KV events (call on the event loop once the engine runs)."""
        if self.config.kv_events is None or self.engine is None:
            return
        from pdserve.vllm_kv_events import KvEventEndpoints, ZmqKvEventSource

        block_size = self.engine.vllm_config.cache_config.block_size
        self.kv_mirror = KvCacheMirror(block_size)
        self._kv_source = ZmqKvEventSource(KvEventEndpoints(*self.config.kv_events),
                                           block_size, self.kv_mirror.apply, loop)
        self._kv_source.start()

    def shutdown(self) -> None:
        if self._kv_source is not None:
            self._kv_source.close()
            self._kv_source = None
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
        if self.config.kv_events is not None:
            from pdserve.vllm_kv_events import KvEventEndpoints

            KvEventEndpoints(*self.config.kv_events).remove_files()

    def identity(self) -> dict[str, Any]:
        cfg = self.config
        dtype = cfg.dtype
        block_size = 0
        if self.engine is not None:
            vcfg = self.engine.vllm_config
            dtype = str(vcfg.model_config.dtype).removeprefix("torch.")
            block_size = vcfg.cache_config.block_size or 0
        compat = {"model": cfg.served_model_name, "dtype": dtype, "block_size": block_size,
                  "transport": cfg.connector.transport}
        digest = hashlib.sha256(json.dumps(compat, sort_keys=True).encode()).hexdigest()[:16]
        return dict(compat, max_model_len=cfg.max_model_len, compatibility_hash=digest)

    async def generate(
        self,
        request_id: str,
        phase: str,
        prompt_token_ids: list[int],
        sampling: SamplingSpec,
        kv_handle: KVHandle | None,
        push_target: PushTarget | None = None,
    ) -> AsyncIterator[PhaseOutput]:
        if self.engine is None:
            raise RuntimeError("engine is not ready")
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        hold_kv = phase == "prefill" and sampling.max_tokens > 1
        params: dict[str, Any] | None = None
        if hold_kv:
            params = {"do_remote_decode": True}
            if push_target is not None and self.kv_push:
                params["push"] = {"host": push_target.host, "port": push_target.port,
                                  "transfer_id": push_target.transfer_id}
        elif phase == "decode" and kv_handle is not None:
            params = dict(kv_handle.to_params(), do_remote_prefill=True)
        sp = SamplingParams(
            max_tokens=1 if phase == "prefill" else sampling.max_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k if sampling.top_k > 0 else 0,
            seed=sampling.seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        self._inflight.add(request_id)
        try:
            stream = self.engine.generate(
                TokensPrompt(prompt_token_ids=prompt_token_ids), sp, request_id
            )
            async for out in stream:
                completion = out.outputs[0]
                finish = completion.finish_reason if out.finished else None
                handle = None
                if out.finished and out.kv_transfer_params and hold_kv:
                    handle = KVHandle.from_params(out.kv_transfer_params)
                    self._leases[request_id] = handle
                yield PhaseOutput(
                    token_ids=tuple(completion.token_ids),
                    finish_reason=_finish_reason(finish) if out.finished else None,
                    kv_handle=handle,
                    num_cached_tokens=out.num_cached_tokens or 0,
                    num_prompt_tokens=len(prompt_token_ids),
                )
        finally:
            self._inflight.discard(request_id)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request and release any KV lease it holds here."""
        found = request_id in self._inflight
        if found and self.engine is not None:
            await self.engine.abort(request_id)
        handle = self._leases.pop(request_id, None)
        if handle is not None:
            found = True
            await asyncio.to_thread(self._release, handle)
        return found

    def kv_status(self) -> dict[str, Any]:
        """The connector's own counters, from its KV endpoint in the Worker process."""
        cfg = self.config.connector
        try:
            return request_once("127.0.0.1", cfg.kv_port, {"op": "status"}, 2.0)
        except TransferError as exc:
            logger.warning("KV endpoint status unavailable: %s", exc)
            return {}

    def prune_leases(self) -> None:
        now_ns = time.time_ns()
        for rid in [r for r, h in self._leases.items() if h.lease_deadline_unix_ns < now_ns]:
            del self._leases[rid]

    def _release(self, handle: KVHandle) -> None:
        try:
            request_once(handle.host, handle.port,
                         {"op": "release", "req": handle.remote_request_id}, _CONTROL_TIMEOUT_S)
        except TransferError as exc:  # the lease expires on its own
            logger.warning("release of %s failed: %s", handle.remote_request_id, exc)


def _finish_reason(reason: str | None) -> str:
    if reason in ("stop", "length", "abort", "error"):
        return reason
    return "stop" if reason is None else "error"
