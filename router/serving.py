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
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from pdserve.types import TokenLogprobs

from .cancellation import (
    ClientDisconnectedError,
    ClosingStreamingResponse,
    close_now,
    closing,
    until_disconnect,
)
from .choices import ChoiceStreams, fan_in, single_choice
from .deadline import TIMEOUT_HEADER, Deadline, request_timeout_s
from .detokenize import IncrementalDetokenizer, TokenDecoder
from .disagg import DisaggDecision
from .errors import APIError, to_api_error
from .logprobs import LogprobText
from .metrics import RouterMetrics
from .outcome import CLIENT_CLOSED, outcome_reason, record_outcome
from .preprocess import GenerationRequest
from .responses import (
    SSE_DONE,
    ChoiceOutput,
    FinalOutput,
    OutputDelta,
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


class RequestOutput:
    """One choice's output as chunks arrive: text, stop strings, finish reason, logprobs,
    metrics (the time to first token on choice 0 only)."""

    def __init__(self, request: GenerationRequest, decoder: TokenDecoder, metrics: RouterMetrics,
                 scope: Scope | None = None, index: int = 0):
        self.request = request
        self.scope = scope  # the HTTP request's, where the outcome is recorded
        self.index = index
        self.detokenizer = IncrementalDetokenizer(
            decoder, stop=request.stop, skip_special_tokens=request.skip_special_tokens)
        self.finish_reason: str | None = None
        self.num_cached_tokens = 0
        self.disagg: DisaggDecision | None = None
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()
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

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def consume(self, chunk: TokenChunk) -> OutputDelta:
        """Add a chunk; chunks after the end (there should be none) add nothing."""
        self._observe(chunk)
        if self.finish_reason is not None:
            return OutputDelta("", [], None, self.index)
        if chunk.finish_reason in ("error", "abort"):
            raise WorkerFailedError(f"the workers ended the request ({chunk.finish_reason})")
        before = len(self.token_ids)
        # An engine's "stop" is a stop token (end of sequence, stop_token_ids; stop
        # strings are the router's own): counted, its text not output, as in vLLM.
        last_stops = (chunk.finish_reason == "stop" and bool(chunk.token_ids)
                      and chunk.token_ids[-1] in self.request.stop_token_set)
        text = self.detokenizer.add(chunk.token_ids, last_stops=last_stops)
        if not self.stopped_by_string and chunk.finish_reason is not None:
            text += self.detokenizer.finish()
        if self.stopped_by_string:
            self.finish_reason = "stop"
        elif chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
        self._texts.append(text)
        new_ids = self.token_ids[before:]
        positions = chunk.logprobs[:len(new_ids)]
        self.logprobs.extend(positions)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        return OutputDelta(text, new_ids, self.finish_reason, self.index, positions,
                           chunk.prompt_logprobs, self.token_ids[:before])

    def final(self) -> ChoiceOutput:
        return ChoiceOutput(self.text, self.token_ids, self.check_finished(), self.index,
                            self.logprobs, self.prompt_logprobs)

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
            if self.index == 0:
                self._metrics.time_to_first_token.observe(now - self.request.arrival_s)
        elif chunk.token_ids:
            self._metrics.inter_token_latency.observe((now - last) / len(chunk.token_ids))
        self._last_chunk_s = now
        self._metrics.generation_tokens.inc(len(chunk.token_ids))


class Choices:
    """One request's choices: their outputs and the stream of their chunks."""

    def __init__(self, outputs: list[RequestOutput],
                 chunks: AsyncIterator[tuple[int, TokenChunk]],
                 streams: ChoiceStreams | None = None) -> None:
        self.outputs = outputs
        self.chunks = chunks
        self._streams = streams

    @property
    def first(self) -> RequestOutput:
        return self.outputs[0]

    @property
    def done(self) -> bool:
        return all(o.done for o in self.outputs)

    def consume(self, index: int, chunk: TokenChunk) -> OutputDelta:
        return self.outputs[index].consume(chunk)

    async def after(self, delta: OutputDelta) -> bool:
        """Whether to read on after ``delta``: a choice ended by its stop string is
        stopped alone (its workers abort it); the request stops once every choice has."""
        output = self.outputs[delta.index]
        if output.stopped_by_string and self._streams is not None and not self.done:
            await self._streams.close_choice(delta.index)
        return not (output.stopped_by_string and self.done)

    def final(self) -> FinalOutput:
        return FinalOutput([o.final() for o in self.outputs], self.first.num_cached_tokens,
                           _decision(self.first))

    @property
    def num_completion_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


class OpenAIServing:
    """Answers ``GenerationRequest``s: a JSON body, or an SSE stream."""

    def __init__(self, *, dispatcher: Dispatcher, decoder: TokenDecoder, metrics: RouterMetrics,
                 request_timeout_s: float = 600.0):
        self._dispatcher = dispatcher
        self._request_timeout_s = request_timeout_s
        self._decoder = decoder
        self._logprob_text = LogprobText(decoder)
        self._metrics = metrics

    async def serve(self, request: GenerationRequest, http: Request) -> Response:
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        outputs = [RequestOutput(request, self._decoder, self._metrics,
                                 http.scope if i == 0 else None, i) for i in range(request.n)]
        try:
            timeout_s = request_timeout_s(http.headers.get(TIMEOUT_HEADER),
                                          self._request_timeout_s)
            choices = self._start(request, outputs,
                                  Deadline.after(timeout_s, request.arrival_s))
        except Exception as exc:  # a dispatcher may refuse before returning an iterator
            return self._fail(outputs, exc)
        if request.stream:
            return await self._open_stream(choices, http)
        return await self._complete(choices, http)

    def _start(self, request: GenerationRequest, outputs: list[RequestOutput],
               deadline: Deadline) -> Choices:
        """The dispatcher's chunks of every choice (``choices.py``: ``n`` > 1)."""
        if request.n == 1:
            chunks = self._dispatcher.generate(
                request.request_id, request.prompt_token_ids, request.sampling,
                RequestTimeline(request.request_id, request.arrival_s), deadline=deadline)
            return Choices(outputs, single_choice(chunks))

        def open_choice(index: int, affinity: str | None) -> AsyncIterator[TokenChunk]:
            sampling = request.sampling
            if sampling.seed is not None:
                sampling = replace(sampling, seed=sampling.seed + index)
            request_id = f"{request.request_id}-{index}"
            return self._dispatcher.generate(
                request_id, request.prompt_token_ids, sampling,
                RequestTimeline(request_id, request.arrival_s), deadline=deadline,
                affinity=affinity)

        streams = ChoiceStreams(request.n, open_choice)
        return Choices(outputs, fan_in(streams), streams)

    async def _complete(self, choices: Choices, http: Request) -> Response:
        try:
            await until_disconnect(http, lambda: _collect(choices))
            final = choices.final()
        except BaseException as exc:
            return self._fail(choices.outputs, exc)
        self._finish(choices.outputs, 200, "ok")
        formatter = formatter_for(choices.first.request, self._logprob_text)
        body = formatter.response(final).model_dump_json()
        return Response(body, media_type="application/json", headers=choices.first.headers())

    async def _open_stream(self, choices: Choices, http: Request) -> Response:
        """Get the first chunk before answering, so early failures keep their status code."""
        try:
            index, first = await until_disconnect(http, lambda: _first_chunk(choices.chunks))
            first_delta = choices.consume(index, first)
        except BaseException as exc:
            await close_now(choices.chunks)
            return self._fail(choices.outputs, exc)
        return ClosingStreamingResponse(
            self._events(choices, first_delta),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     **choices.first.headers()},
        )

    async def _events(self, choices: Choices, first: OutputDelta) -> AsyncIterator[bytes]:
        """SSE body. One write per dispatcher chunk, never batched across chunks."""
        request = choices.first.request
        formatter = formatter_for(request, self._logprob_text)
        status, reason = 200, "ok"
        try:
            async with closing(choices.chunks):
                yield formatter.encode_stream(first, first=True)
                more = await choices.after(first)
                while more:
                    item = await anext(choices.chunks, None)
                    if item is None:
                        break
                    delta = choices.consume(*item)
                    if events := formatter.encode_stream(delta, first=False):
                        yield events
                    more = await choices.after(delta)
            for output in choices.outputs:
                output.check_finished()
            if request.include_usage:
                usage = formatter.usage(choices.num_completion_tokens,
                                        choices.first.num_cached_tokens,
                                        _decision(choices.first))
                yield sse_event(formatter.usage_event(usage))
        except Exception as exc:  # the stream has started: report in-band
            error = _log_unexpected(exc)
            status, reason = error.status_code, outcome_reason(error)
            yield sse_error(error)
        except BaseException:
            status, reason = CLIENT_CLOSED_REQUEST, CLIENT_CLOSED
            raise
        finally:
            self._finish(choices.outputs, status, reason)
        yield SSE_DONE

    def _fail(self, outputs: list[RequestOutput], exc: BaseException) -> Response:
        """Answer a failure that happened before the response started; a cancellation is
        logged and re-raised."""
        if isinstance(exc, ClientDisconnectedError) or not isinstance(exc, Exception):
            self._finish(outputs, CLIENT_CLOSED_REQUEST, CLIENT_CLOSED)
            if isinstance(exc, ClientDisconnectedError):
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            raise exc
        error = _log_unexpected(exc)
        self._finish(outputs, error.status_code, outcome_reason(error))
        return JSONResponse(error.body(), status_code=error.status_code)

    def _finish(self, outputs: list[RequestOutput], status: int, reason: str) -> None:
        """Log the request's end, and record its outcome for the HTTP metrics."""
        output = outputs[0]
        if output.scope is not None:
            record_outcome(output.scope, status, reason)
        latency_s = time.perf_counter() - output.request.arrival_s
        if status == 200:
            self._metrics.e2e_latency.observe(latency_s)
            for choice in outputs:
                self._metrics.on_success(choice.finish_reason or "")
        logger.info(
            "%s status=%d prompt_tokens=%d completion_tokens=%d cached_tokens=%d "
            "finish_reason=%s latency=%.3fs",
            output.request.request_id,
            status,
            len(output.request.prompt_token_ids),
            sum(len(o.token_ids) for o in outputs),
            output.num_cached_tokens,
            ",".join(str(o.finish_reason) for o in outputs),
            latency_s,
        )


async def _collect(choices: Choices) -> None:
    async with closing(choices.chunks):
        async for index, chunk in choices.chunks:
            if not await choices.after(choices.consume(index, chunk)):
                break


def _decision(output: RequestOutput) -> str | None:
    return None if output.disagg is None else output.disagg.decision


def _log_unexpected(exc: Exception) -> APIError:
    """Map to the OpenAI error; an exception nobody planned for is a bug: log its traceback."""
    if not isinstance(exc, APIError | NoWorkerAvailableError | WorkerFailedError
                      | DeadlineExceededError):
        logger.exception("unexpected error while serving a request")
    return to_api_error(exc)


async def _first_chunk(chunks: AsyncIterator[tuple[int, TokenChunk]]) -> tuple[int, TokenChunk]:
    item = await anext(chunks, None)
    if item is None:
        raise WorkerFailedError("the dispatcher ended the stream before any chunk")
    return item
