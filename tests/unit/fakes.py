"""Shared fakes and helpers for unit tests (no vLLM, no network beyond 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.model import DEFAULT_MODEL_NAME
from pdserve.core.types import FinishReason, SamplingSpec, TokenLogprobs
from pdserve.router.dispatch.base import (
    ChunkSink,
    Dispatcher,
    NoWorkerAvailableError,
    TokenChunk,
    WorkerFailedError,
)
from pdserve.router.http.app import create_app
from pdserve.router.http.edge.config import EdgeConfig
from pdserve.router.http.edge.pipelining import PipelinedHttpToolsProtocol

if TYPE_CHECKING:
    import httpx2


@functools.lru_cache(maxsize=1)
def default_tokenizer() -> Any:
    """The default model's real tokenizer, loaded once per process."""
    from pdserve.core.model import prepare_default_model
    from pdserve.core.tokenizer import load_tokenizer

    return load_tokenizer(prepare_default_model())


@dataclass(frozen=True)
class DispatchCall:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    deadline: Any = None  # the router.deadline.Deadline the HTTP layer fixed
    affinity: str | None = None  # the decode worker a later choice (n > 1) follows


@dataclass
class FakeDispatcher:
    """A scripted ``Dispatcher``: yields ``output_ids`` (cut at ``max_tokens``, then finish
    reason "length"), ``tokens_per_chunk`` at a time, ``delay_s`` before each chunk.

    ``error_on_call`` is raised by ``generate`` itself (a dispatcher refusing at once),
    ``error_before_first`` before any chunk; ``fail_after_chunks`` raises
    ``WorkerFailedError`` after that many chunks. ``gate``, when given, holds every chunk
    after the first until it is set (an event of the loop the app runs on): a request
    that runs, mid-stream, for as long as a test needs. A request whose iterator is closed before
    its end (including right after the last chunk) is recorded in ``aborted``; the lists
    are appended from whichever thread runs the app and are safe to poll from another.
    """

    output_ids: Sequence[int] = ()
    finish_reason: FinishReason = "stop"
    tokens_per_chunk: int = 1
    delay_s: float = 0.0
    num_cached_tokens: int | None = None
    error_on_call: Exception | None = None
    error_before_first: Exception | None = None
    fail_after_chunks: int | None = None
    gate: asyncio.Event | None = None
    ready: bool = True
    # Chunks carry this decode worker id (what a later choice of n > 1 follows), and
    # per token the logprobs ``fake_logprobs`` makes (the prompt's on the first chunk).
    decode_worker_id: str | None = None
    logprobs: bool = False
    end_token: int | None = None  # appended to a "stop" output, as an engine's end of text
    weight_version: str | None = None  # the chunks' (the workers' weights)
    calls: list[DispatchCall] = field(default_factory=list)
    express_taken: int = 0  # tokens the chunk sinks of its requests took
    completed: list[str] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def is_ready(self) -> bool:
        return self.ready

    def generate(
        self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingSpec,
        timeline: object = None, deadline: Any = None, affinity: str | None = None,
        sink: ChunkSink | None = None,
    ) -> AsyncGenerator[TokenChunk, None]:
        self.calls.append(DispatchCall(request_id, tuple(prompt_token_ids), sampling,
                                       deadline, affinity))
        if self.error_on_call is not None:
            raise self.error_on_call
        return self._run(request_id, sampling, sink)

    async def _run(self, request_id: str, sampling: SamplingSpec,
                   sink: ChunkSink | None = None) -> AsyncGenerator[TokenChunk, None]:
        outcome = self.aborted
        try:
            async for chunk in self._chunks(sampling):
                # The sink, as the real dispatcher offers it: each ordinary chunk,
                # while the reader waits for it (here, inside its ``anext``).
                if (sink is not None and sink.accepting and chunk.finish_reason is None
                        and not chunk.logprobs and chunk.num_cached_tokens is None
                        and sink.offer(chunk)):
                    self.express_taken += len(chunk.token_ids)
                    continue
                yield chunk
            outcome = self.completed
        except (NoWorkerAvailableError, WorkerFailedError):
            outcome = self.failed
            raise
        finally:
            outcome.append(request_id)

    async def _chunks(self, sampling: SamplingSpec) -> AsyncGenerator[TokenChunk, None]:
        if self.error_before_first is not None:
            raise self.error_before_first
        ids = list(self.output_ids)[: sampling.max_tokens]
        finish = "length" if len(self.output_ids) > sampling.max_tokens else self.finish_reason
        if finish == "stop" and self.end_token is not None and len(ids) < sampling.max_tokens:
            ids.append(self.end_token)  # an engine stops on a stop token
        step = self.tokens_per_chunk
        pieces = [tuple(ids[i : i + step]) for i in range(0, len(ids), step)] or [()]
        for index, piece in enumerate(pieces):
            if self.fail_after_chunks is not None and index == self.fail_after_chunks:
                raise WorkerFailedError("decode worker crashed")
            if self.gate is not None and index > 0:
                await self.gate.wait()
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            last = index == len(pieces) - 1
            yield TokenChunk(
                token_ids=piece,
                finish_reason=finish if last else None,
                num_cached_tokens=self.num_cached_tokens if index == 0 else None,
                logprobs=tuple(fake_logprobs(t) for t in piece) if self.logprobs else (),
                prompt_logprobs=self._prompt_logprobs(sampling) if index == 0 else (),
                decode_worker_id=self.decode_worker_id,
                weight_version=self.weight_version,
            )

    def _prompt_logprobs(self, sampling: SamplingSpec) -> tuple[TokenLogprobs, ...]:
        if sampling.prompt_logprobs is None or not self.calls:
            return ()
        prompt = self.calls[-1].prompt_token_ids
        return (TokenLogprobs(prompt[0]), *(fake_logprobs(t) for t in prompt[1:]))


END_OF_TEXT = 2  # SmolLM2's <|im_end|>, its end of sequence


def fake_logprobs(token_id: int) -> TokenLogprobs:
    """The token (rank 2), a likelier neighbour, and an impossible one (-inf)."""
    return TokenLogprobs(token_id, ((token_id, -0.75, 2), (token_id + 1, -0.5, 1),
                                    (token_id + 2, float("-inf"), 3)))


class Clock:
    """A clock a test moves by hand (``clock.now += 5``), for code given a clock."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    """Poll ``condition`` until it holds or the deadline passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@contextlib.contextmanager
def serve_in_thread(app: Any, send_buffer: int | None = None,
                    http: Any = PipelinedHttpToolsProtocol) -> Iterator[str]:
    """Run ``app`` in a real uvicorn server on 127.0.0.1 (a free port); yield its base URL.
    ``send_buffer``: the connections' kernel send buffer (bytes), to fill it soon.
    ``http``: uvicorn's HTTP protocol (by default the one ``pdserve router`` runs)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if send_buffer is not None:  # accepted connections inherit it
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=2,
                            http=http)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        if not wait_until(lambda: server.started, timeout_s=10.0):
            raise RuntimeError("uvicorn did not start")
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        sock.close()


# --- router test helpers ---------------------------------------------------------------

ROUTER_MODEL = DEFAULT_MODEL_NAME
ROUTER_MAX_MODEL_LEN = 256
COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
USER_MESSAGES = [{"role": "user", "content": "hi"}]


# The cluster secret of the routers built here: it keys the tenants' salts.
ROUTER_SECRET = ClusterSecret(b"router-test-cluster-secret-0123456789")


def make_router_app(tokenizer: Any, dispatcher: Dispatcher,
                    edge: EdgeConfig | None = None,
                    registry: CollectorRegistry | None = None,
                    secret: ClusterSecret | None = ROUTER_SECRET) -> FastAPI:
    return create_app(
        served_model_name=ROUTER_MODEL,
        max_model_len=ROUTER_MAX_MODEL_LEN,
        tokenizer=tokenizer,
        dispatcher=dispatcher,
        edge=edge,
        registry=registry,
        secret=secret,
    )


def cmpl_body(**fields: Any) -> dict[str, Any]:
    """A valid /v1/completions body, with ``fields`` added or replaced."""
    return {"model": ROUTER_MODEL, "prompt": "hi", **fields}


def chat_body(**fields: Any) -> dict[str, Any]:
    """A valid /v1/chat/completions body, with ``fields`` added or replaced."""
    return {"model": ROUTER_MODEL, "messages": USER_MESSAGES, **fields}


def asgi_http_client(app: FastAPI) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")


def asgi_openai_client(app: FastAPI) -> openai.AsyncOpenAI:
    """The official client, talking to ``app`` in process (no retries: errors surface)."""
    return openai.AsyncOpenAI(
        api_key="unused",
        base_url="http://test/v1",
        # openai's annotations name httpx2's client; this has always passed an httpx one
        http_client=cast("httpx2.AsyncClient",
                         httpx.AsyncClient(transport=httpx.ASGITransport(app=app))),
        max_retries=0,
    )


def sse_payloads(body: str) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded, then the final ``"[DONE]"``."""
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]] + ["[DONE]"]
