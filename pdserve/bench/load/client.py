"""One streamed request against an OpenAI-compatible endpoint, timed as ``vllm bench
serve`` times it (see ``metrics.py``; one difference: only chunks that carry text are
token chunks, see ``_has_text``), with a deadline and an error kind on failure.

Error kinds: ``http_<status>`` (refused: 4xx/5xx before the stream), ``connect``,
``timeout`` (the per-request deadline, or httpx's), ``disconnected`` (the connection
broke mid-stream), ``stream_error`` (an SSE error event), ``incomplete`` (the stream
ended without ``[DONE]``), ``no_tokens`` (``[DONE]`` without a token chunk),
``bad_chunk`` (an event that is not JSON).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.load.metrics import RequestRecord
from pdserve.bench.workload.prompts import BenchRequest, PromptEncoder


@dataclass(frozen=True)
class Endpoint:
    """Where and how to send: ``base_url`` ends in ``/v1``."""

    base_url: str
    model: str
    endpoint: str  # "chat" | "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = 600.0

    @staticmethod
    def normalize(url: str) -> str:
        url = url.rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--base-url {url!r}: expected http://HOST:PORT[/v1]")
        return url if url.endswith("/v1") else url + "/v1"

    @property
    def url(self) -> str:
        return self.base_url + ("/chat/completions" if self.endpoint == "chat" else "/completions")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class RequestFailed(Exception):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail = kind, detail


def _payload(ep: Endpoint, encoder: PromptEncoder, req: BenchRequest) -> dict[str, Any]:
    body = {"model": ep.model, **encoder.body(req.messages, req.prompt_ids),
            "max_tokens": req.output_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if ep.ignore_eos:
        body["ignore_eos"] = True
    return body


def _has_text(choices: Any) -> bool:
    """A token chunk: its choice carries text (completions) or content (chat). vLLM's
    ``bench serve`` counts any chunk with a choice; servers that close a stream with a
    chunk holding only ``finish_reason`` (pdserve's router does) would then get one extra
    ITL of ~0 s per request, and chat's role-only opening chunk an early TTFT."""
    if not choices or not isinstance(choices, list) or not isinstance(choices[0], dict):
        return False
    choice = choices[0]
    delta = choice.get("delta") or {}
    return bool(choice.get("text") or delta.get("content") or delta.get("reasoning_content"))


class _Stream:
    """The timing state of one response stream."""

    def __init__(self, start: float, record: RequestRecord) -> None:
        self.start, self.last, self.record = start, start, record
        self.num_chunks, self.usage, self.done = 0, False, False

    def on_event(self, data: str) -> None:
        if data == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            raise RequestFailed("bad_chunk", data[:200]) from None
        if "error" in event:
            raise RequestFailed("stream_error", json.dumps(event["error"])[:300])
        if _has_text(event.get("choices")):
            if self.num_chunks == 0:
                self.record.ttft_s = now - self.start
            else:
                self.record.itls_s.append(now - self.last)
            self.num_chunks += 1
            self.last = now
        if usage := event.get("usage"):
            self.usage = True
            self.record.prompt_tokens = usage.get("prompt_tokens", self.record.prompt_tokens)
            self.record.output_tokens = usage.get("completion_tokens") or 0
            details = usage.get("prompt_tokens_details") or {}
            self.record.cached_tokens = int(details.get("cached_tokens") or 0)

    def finish(self) -> None:
        if not self.done:
            raise RequestFailed("incomplete", "the stream ended without [DONE]")
        if self.num_chunks == 0:
            raise RequestFailed("no_tokens", "no chunk with a choice before [DONE]")
        self.record.e2e_s = self.last - self.start
        if not self.usage:  # the server ignored include_usage: count chunks
            self.record.output_tokens = self.num_chunks


async def _stream(client: httpx.AsyncClient, ep: Endpoint, body: dict[str, Any],
                  state: _Stream) -> None:
    async with client.stream("POST", ep.url, json=body, headers=ep.headers) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RequestFailed(f"http_{resp.status_code}", text[:300])
        async for line in resp.aiter_lines():
            if line.startswith("data:"):
                state.on_event(line[5:].strip())
    state.finish()


async def send(client: httpx.AsyncClient, ep: Endpoint, encoder: PromptEncoder,
               req: BenchRequest, run_start: float) -> tuple[RequestRecord, str | None]:
    """Send ``req``; the record (``error`` set on failure) and the failure's detail."""
    start = time.perf_counter()
    record = RequestRecord(prompt_tokens=req.prompt_tokens, start_s=start - run_start)
    state = _Stream(start, record)
    try:
        async with asyncio.timeout(ep.timeout_s):
            await _stream(client, ep, _payload(ep, encoder, req), state)
        return record, None
    except RequestFailed as exc:
        failure = exc
    except (TimeoutError, httpx.TimeoutException) as exc:
        failure = RequestFailed("timeout", f"no answer within {ep.timeout_s} s ({exc!r})")
    except httpx.ConnectError as exc:
        failure = RequestFailed("connect", str(exc) or repr(exc))
    except (httpx.HTTPError, httpx.StreamError, OSError) as exc:
        failure = RequestFailed("disconnected", str(exc) or repr(exc))
    record.error = failure.kind
    return record, failure.detail
