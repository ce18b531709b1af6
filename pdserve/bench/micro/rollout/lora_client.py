"""``pdserve bench rollout-lora``'s HTTP side, the same for both systems: streamed chat
completions under the adapter (each recorded as a ``Sample``: never raises for the
server's answer), and vLLM's RL refit calls (``/pause``, ``/v1/load_lora_adapter``,
``/resume``) on the admin routes (pdserve: its admin listener; vLLM: its one port),
which raise ``LoraCheckError`` for any answer but 200. Every call is under the bench's
deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import httpx

from pdserve.bench.micro.rollout.client import sse_chunks
from pdserve.bench.micro.rollout.lora_report import LoraCheckError, Sample
from pdserve.bench.workload.prompts import Messages


def _detail(reply: httpx.Response) -> str:
    return reply.text[:300].replace("\n", " ")


class LoraClient:
    """``url``: the OpenAI API; ``admin_url``: where ``/pause`` and the LoRA routes
    answer. An async context manager. ``transport``: both clients' (tests)."""

    def __init__(self, url: str, admin_url: str, model: str, deadline_s: float,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.model, self.deadline_s = model, deadline_s
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
        self.api = httpx.AsyncClient(base_url=url.rstrip("/"), timeout=deadline_s,
                                     limits=limits, transport=transport)
        self.admin = httpx.AsyncClient(base_url=admin_url.rstrip("/"), timeout=deadline_s,
                                       transport=transport)

    async def __aenter__(self) -> LoraClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.api.aclose()
        await self.admin.aclose()

    async def stream(self, kind: str, messages: Messages, n: int, max_tokens: int,
                     temperature: float, seed: int) -> Sample:
        """One streamed ``n``-sample completion under the adapter, recorded."""
        sample = Sample(kind=kind, started_s=time.monotonic(), n=n)
        body = {"model": self.model, "messages": messages, "n": n, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed, "stream": True,
                "stream_options": {"include_usage": True}, "return_token_ids": True}
        try:
            async with asyncio.timeout(self.deadline_s):
                await self._read(body, sample)
        except TimeoutError:
            sample.error = f"no end within {self.deadline_s:.0f} s"
        except (httpx.HTTPError, ValueError) as exc:
            sample.error = f"{type(exc).__name__}: {exc}"
        sample.ended_s = time.monotonic()
        return sample

    async def _read(self, body: dict[str, Any], sample: Sample) -> None:
        async with self.api.stream("POST", "/v1/chat/completions", json=body) as reply:
            sample.status = reply.status_code
            async for chunk in sse_chunks(reply, sample):
                take_chunk(sample, chunk, time.monotonic())

    async def _admin(self, what: str, path: str, **kwargs: Any) -> dict[str, Any]:
        async with asyncio.timeout(self.deadline_s):
            reply = await self.admin.post(path, **kwargs)
        if reply.status_code != 200:
            raise LoraCheckError(f"{what}: HTTP {reply.status_code} {_detail(reply)}")
        try:
            return dict(reply.json())
        except ValueError:  # vLLM's load answers plain text
            return {"text": reply.text[:300]}

    async def pause(self, mode: str, clear_cache: bool, timeout_s: float) -> dict[str, Any]:
        params = {"mode": mode, "clear_cache": str(clear_cache).lower(),
                  "timeout": f"{timeout_s:g}"}
        return await self._admin(f"/pause?mode={mode}", "/pause", params=params)

    async def load(self, name: str, path: str) -> dict[str, Any]:
        body = {"lora_name": name, "lora_path": path, "load_inplace": True}
        return await self._admin(f"load {name} from {path}", "/v1/load_lora_adapter",
                                 json=body)

    async def resume(self) -> dict[str, Any]:
        return await self._admin("/resume", "/resume")


def take_chunk(sample: Sample, chunk: dict[str, Any], now: float) -> None:
    """One SSE chunk into ``sample``: each choice's tokens (its ``token_ids``, else one
    per chunk with text) and ``finish_reason``; its ``system_fingerprint``; the usage's
    ``weight_versions``."""
    for choice in chunk.get("choices") or ():
        index = int(choice.get("index", 0))
        ids = choice.get("token_ids")
        delta = choice.get("delta") or {}
        count = len(ids) if ids is not None else int(bool(delta.get("content")))
        if count:
            sample.tokens[index] = sample.tokens.get(index, 0) + count
            if math.isnan(sample.first_token_s):
                sample.first_token_s = now
        sample.tokens.setdefault(index, 0)
        if choice.get("finish_reason") is not None:
            sample.finish[index] = choice["finish_reason"]
    if chunk.get("system_fingerprint"):
        sample.fingerprints.add(str(chunk["system_fingerprint"]))
    usage = chunk.get("usage") or {}
    if usage.get("weight_versions") is not None:
        sample.spans = list(usage["weight_versions"])
