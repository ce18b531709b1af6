"""Runs one ``GenerationRequest`` on the dispatcher and answers it, streaming or not.

Abort rule: the dispatcher's chunk iterator is closed (``aclose()``, shielded from
cancellation so the dispatcher can finish its cleanup) whenever the router stops
reading before the end: a stop string matched, the client went away, or an error.
After the chunk carrying ``finish_reason`` the router reads on until the iterator ends,
so a normally finished request is never closed early.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from .cancellation import (
    ClientDisconnectedError,
    ClosingStreamingResponse,
    close_now,
    closing,
    until_disconnect,
)
from .deadline import TIMEOUT_HEADER, Deadline, request_timeout_s
from .detokenize import IncrementalDetokenizer, TokenDecoder
from .disagg import DisaggDecision
from .errors import APIError, to_api_error
from .metrics import RouterMetrics
from .outcome import CLIENT_CLOSED, outcome_reason, record_outcome
from .preprocess import GenerationRequest
from .responses import (
    SSE_DONE,
    FinalOutput,
    ResponseFormatter,
    formatter_for,
    sse_error,
    sse_event,
)
from .timeline import RequestTimeline
from .types import (
    DeadlineExceededError,
    Dispatcher,
    NoWorkerAvailableError,
    TokenChunk,
    WorkerFailedError,
)

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; only in metrics and logs
DISAGG_HEADER = "x-pdserve-disagg"  # "<local|remote>; reason=<rule>", see router/disagg.py


@dataclass(frozen=True)
class OutputDelta:
    """What one dispatcher chunk adds; ``finish_reason`` only on the chunk that ends it."""

    text: str
    token_ids: list[int]
    finish_reason: str | None


class RequestOutput:
    """One request's output as chunks arrive: text, stop strings, finish reason, metrics."""

    def __init__(self, request: GenerationRequest, decoder: TokenDecoder, metrics: RouterMetrics,
                 scope: Scope | None = None):
        self.request = request
        self.scope = scope  # the HTTP request's, where the outcome is recorded
        self.detokenizer = IncrementalDetokenizer(decoder, stop=request.stop)
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.disagg: DisaggDecision | None = None
        self._texts: list[str] = []
        self._metrics = metrics
        self._last_chunk_s: float | None = None

    @property
    def text(self) -> str:
        return "".join(self._texts)

    @property
    def token_ids(self) -> list[int]:
        return self.detokenizer.token_ids

    @property
    def stopped_by_string(self) -> bool:
        return self.detokenizer.stopped

    def consume(self, chunk: TokenChunk) -> OutputDelta:
        """Add a chunk; chunks after the end (there should be none) add nothing."""
        self._observe(chunk)
        if self.finish_reason is not None:
            return OutputDelta("", [], None)
        if chunk.finish_reason in ("error", "abort"):
            raise WorkerFailedError(f"the workers ended the request ({chunk.finish_reason})")
        before = len(self.token_ids)
        text = self.detokenizer.add(chunk.token_ids)
        if not self.stopped_by_string and chunk.finish_reason is not None:
            text += self.detokenizer.finish()
        if self.stopped_by_string:
            self.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        self._texts.append(text)
        return OutputDelta(text, self.token_ids[before:], self.finish_reason)

    def headers(self) -> dict[str, str]:
        """The disaggregation decision, known from the first chunk on (before any byte of
        the body), as a header on streaming and non-streaming responses alike."""
        return {} if self.disagg is None else {DISAGG_HEADER: self.disagg.header()}

    def check_finished(self) -> str:
        if self.finish_reason is None:
            raise WorkerFailedError("the dispatcher ended the stream without a finish reason")
        return self.finish_reason

    def _observe(self, chunk: TokenChunk) -> None:
        last = self._last_chunk_s
        if last is None:
            self.num_cached_tokens = chunk.num_cached_tokens or 0
            self.disagg = chunk.disagg
        if not self._metrics.enabled:  # metrics off: not even a clock read per chunk
            self._last_chunk_s = 0.0
            return
        now = time.perf_counter()
        if last is None:
            self._metrics.time_to_first_token.observe(now - self.request.arrival_s)
        elif chunk.token_ids:
            self._metrics.inter_token_latency.observe((now - last) / len(chunk.token_ids))
        self._last_chunk_s = now
        self._metrics.generation_tokens.inc(len(chunk.token_ids))


class OpenAIServing:
    """Answers ``GenerationRequest``s: a JSON body, or an SSE stream."""

    def __init__(self, *, dispatcher: Dispatcher, decoder: TokenDecoder, metrics: RouterMetrics,
                 request_timeout_s: float = 600.0):
        self._dispatcher = dispatcher
        self._request_timeout_s = request_timeout_s
        self._decoder = decoder
        self._metrics = metrics

    async def serve(self, request: GenerationRequest, http: Request) -> Response:
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        output = RequestOutput(request, self._decoder, self._metrics, http.scope)
        try:
            timeout_s = request_timeout_s(http.headers.get(TIMEOUT_HEADER),
                                          self._request_timeout_s)
            chunks = self._dispatcher.generate(
                request.request_id, request.prompt_token_ids, request.sampling,
                RequestTimeline(request.request_id, request.arrival_s),
                deadline=Deadline.after(timeout_s, request.arrival_s),
            )
        except Exception as exc:  # a dispatcher may refuse before returning an iterator
            return self._fail(output, exc)
        if request.stream:
            return await self._open_stream(output, chunks, http)
        return await self._complete(output, chunks, http)

    async def _complete(
        self, output: RequestOutput, chunks: AsyncIterator[TokenChunk], http: Request
    ) -> Response:
        try:
            await until_disconnect(http, lambda: _collect(output, chunks))
            final = FinalOutput(
                text=output.text,
                token_ids=output.token_ids,
                finish_reason=output.check_finished(),
                num_cached_tokens=output.num_cached_tokens,
                disagg=_decision(output),
            )
        except BaseException as exc:
            return self._fail(output, exc)
        self._finish(output, 200, "ok")
        body = formatter_for(output.request).response(final).model_dump_json()
        return Response(body, media_type="application/json", headers=output.headers())

    async def _open_stream(
        self, output: RequestOutput, chunks: AsyncIterator[TokenChunk], http: Request
    ) -> Response:
        """Get the first chunk before answering, so early failures keep their status code."""
        try:
            first = await until_disconnect(http, lambda: _first_chunk(chunks))
            first_delta = output.consume(first)
        except BaseException as exc:
            await close_now(chunks)
            return self._fail(output, exc)
        return ClosingStreamingResponse(
            self._events(output, chunks, first_delta),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     **output.headers()},
        )

    async def _events(
        self, output: RequestOutput, chunks: AsyncIterator[TokenChunk], first: OutputDelta
    ) -> AsyncIterator[bytes]:
        """SSE body. One write per dispatcher chunk, never batched across chunks."""
        formatter = formatter_for(output.request)
        status, reason = 200, "ok"
        try:
            async with closing(chunks):
                yield _encode(formatter, first, first=True)
                while not output.stopped_by_string:
                    chunk = await anext(chunks, None)
                    if chunk is None:
                        break
                    if events := _encode(formatter, output.consume(chunk), first=False):
                        yield events
            output.check_finished()
            if output.request.include_usage:
                usage = formatter.usage(len(output.token_ids), output.num_cached_tokens,
                                        _decision(output))
                yield sse_event(formatter.usage_event(usage))
        except Exception as exc:  # the stream has started: report in-band
            error = _log_unexpected(exc)
            status, reason = error.status_code, outcome_reason(error)
            yield sse_error(error)
        except BaseException:
            status, reason = CLIENT_CLOSED_REQUEST, CLIENT_CLOSED
            raise
        finally:
            self._finish(output, status, reason)
        yield SSE_DONE

    def _fail(self, output: RequestOutput, exc: BaseException) -> Response:
        """Answer a failure that happened before the response started; a cancellation is
        logged and re-raised."""
        if isinstance(exc, ClientDisconnectedError) or not isinstance(exc, Exception):
            self._finish(output, CLIENT_CLOSED_REQUEST, CLIENT_CLOSED)
            if isinstance(exc, ClientDisconnectedError):
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            raise exc
        error = _log_unexpected(exc)
        self._finish(output, error.status_code, outcome_reason(error))
        return JSONResponse(error.body(), status_code=error.status_code)

    def _finish(self, output: RequestOutput, status: int, reason: str) -> None:
        """Log the request's end, and record its outcome for the HTTP metrics."""
        if output.scope is not None:
            record_outcome(output.scope, status, reason)
        latency_s = time.perf_counter() - output.request.arrival_s
        if status == 200:
            self._metrics.e2e_latency.observe(latency_s)
            self._metrics.on_success(output.finish_reason or "")
        logger.info(
            "%s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "finish_reason=%s latency=%.3fs",
            output.request.request_id,
            status,
            len(output.request.prompt_token_ids),
            len(output.token_ids),
            output.num_cached_tokens,
            output.finish_reason,
            latency_s,
        )


async def _collect(output: RequestOutput, chunks: AsyncIterator[TokenChunk]) -> None:
    async with closing(chunks):
        async for chunk in chunks:
            output.consume(chunk)
            if output.stopped_by_string:
                break


def _decision(output: RequestOutput) -> str | None:
    return None if output.disagg is None else output.disagg.decision


def _encode(formatter: ResponseFormatter, delta: OutputDelta, first: bool) -> bytes:
    return formatter.encode_stream(delta.text, delta.token_ids, delta.finish_reason, first)


def _log_unexpected(exc: Exception) -> APIError:
    """Map to the OpenAI error; an exception nobody planned for is a bug: log its traceback."""
    if not isinstance(exc, APIError | NoWorkerAvailableError | WorkerFailedError
                      | DeadlineExceededError):
        logger.exception("unexpected error while serving a request")
    return to_api_error(exc)


async def _first_chunk(chunks: AsyncIterator[TokenChunk]) -> TokenChunk:
    chunk = await anext(chunks, None)
    if chunk is None:
        raise WorkerFailedError("the dispatcher ended the stream before any chunk")
    return chunk
