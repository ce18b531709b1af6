"""Runs one ``GenerationRequest`` on the dispatcher and answers it, streaming or not.

Abort rule: the dispatcher's chunk iterator is closed (``aclose()``, shielded from
cancellation so the dispatcher can finish its cleanup) whenever the router stops
reading before the end: a stop string matched, the client went away, or an error.
After the chunk carrying ``finish_reason`` the router reads on until the iterator ends,
so a normally finished request is never closed early. With ``n`` > 1 choices
(``choices.py``), a stop string closes its own choice, and the others are read to their
end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pdserve.router.dispatch.base import (
    Deadline,
    DeadlineExceededError,
    Dispatcher,
    NoWorkerAvailableError,
    RequestRejectedError,
    TokenChunk,
    WorkerFailedError,
)
from pdserve.router.dispatch.timeline import RequestTimeline
from pdserve.router.http.base import APIError
from pdserve.router.http.edge.cancellation import (
    ClientDisconnectedError,
    ClosingStreamingResponse,
    close_now,
    closing,
    until_disconnect,
)
from pdserve.router.http.edge.request_timeout import TIMEOUT_HEADER, request_timeout_s
from pdserve.router.http.errors import to_api_error
from pdserve.router.http.openai.choices import ChoiceStreams, fan_in, single_choice
from pdserve.router.http.openai.logprobs import LogprobText, PieceTokenizer
from pdserve.router.http.openai.preprocess import GenerationRequest
from pdserve.router.http.openai.request_output import (
    Choices,
    RequestOutput,
    completion_tokens,
    decision_of,
)
from pdserve.router.http.openai.responses import (
    SSE_DONE,
    OutputDelta,
    formatter_for,
    sse_error,
    sse_event,
)
from pdserve.router.http.openai.sessions import SESSION_HEADER, SessionAffinity
from pdserve.router.http.openai.stream_writer import StreamWriter
from pdserve.router.http.outcome import CLIENT_CLOSED, outcome_reason, record_outcome
from pdserve.router.http.tenants.accounts import end_request, on_prompt, on_sequences
from pdserve.router.metrics import RouterMetrics

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499  # nginx's status for "client went away"; only in metrics and logs


class OpenAIServing:
    """Answers ``GenerationRequest``s: a JSON body, or an SSE stream."""

    def __init__(self, *, dispatcher: Dispatcher, decoder: PieceTokenizer, metrics: RouterMetrics,
                 request_timeout_s: float = 600.0):
        self._dispatcher = dispatcher
        self._request_timeout_s = request_timeout_s
        self._decoder = decoder
        self._logprob_text = LogprobText(decoder)
        self._metrics = metrics
        self._sessions = SessionAffinity()

    async def serve(self, request: GenerationRequest, http: Request) -> Response:
        on_sequences(http.scope, request.n)  # its tenant's slots for every sequence
        self._metrics.prompt_tokens.inc(len(request.prompt_token_ids))
        outputs = [RequestOutput(request, self._decoder, self._metrics,
                                 http.scope if i == 0 else None, i) for i in range(request.n)]
        on_prompt(http.scope, len(request.prompt_token_ids), outputs)  # the tenant's
        outputs[0].session_id = http.headers.get(SESSION_HEADER)
        try:
            timeout_s = request_timeout_s(http.headers.get(TIMEOUT_HEADER),
                                          self._request_timeout_s)
            # One choice streamed: its plain chunks may be written as they arrive.
            writer = StreamWriter(http.scope) if request.stream and request.n == 1 else None
            choices = self._start(request, outputs,
                                  Deadline.after(timeout_s, request.arrival_s), writer)
        except Exception as exc:  # a dispatcher may refuse before returning an iterator
            return self._fail(outputs, exc)
        if request.stream:
            return await self._open_stream(choices, http, writer)
        return await self._complete(choices, http)

    def _start(self, request: GenerationRequest, outputs: list[RequestOutput],
               deadline: Deadline, writer: StreamWriter | None) -> Choices:
        """The dispatcher's chunks of every choice (``choices.py``: ``n`` > 1)."""
        if request.n == 1:
            chunks = self._dispatcher.generate(
                request.request_id, request.prompt_token_ids, request.sampling,
                RequestTimeline(request.request_id, request.arrival_s), deadline=deadline,
                affinity=self._sessions.worker_of(outputs[0].session_id), sink=writer)
            return Choices(outputs, single_choice(chunks))

        def open_choice(index: int, affinity: str | None) -> AsyncGenerator[TokenChunk, None]:
            sampling = request.sampling
            if sampling.seed is not None:
                sampling = replace(sampling, seed=sampling.seed + index)
            if index > 0:  # choice 0 computes the prompt and its logprobs for all
                sampling = replace(sampling, prompt_logprobs=None)
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
        formatter = formatter_for(choices.first.request, self._logprob_text,
                                  choices.first.weight_version)
        body = formatter.response(final).model_dump_json()
        return Response(body, media_type="application/json", headers=choices.first.headers())

    async def _open_stream(self, choices: Choices, http: Request,
                           writer: StreamWriter | None) -> Response:
        """Get the first chunk before answering, so early failures keep their status code."""
        try:
            index, first = await until_disconnect(http, lambda: _first_chunk(choices.chunks))
            first_delta = choices.consume(index, first)
        except BaseException as exc:
            await close_now(choices.chunks)
            return self._fail(choices.outputs, exc)
        return ClosingStreamingResponse(
            self._events(choices, first_delta, writer), source=choices.chunks,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no",
                     **choices.first.headers()},
        )

    async def _events(self, choices: Choices, first: OutputDelta,
                      writer: StreamWriter | None) -> AsyncIterator[bytes]:
        """SSE body. One write per dispatcher chunk, never batched across chunks; ``writer``
        writes the plain ones that arrive while this waits (``stream_writer.py``)."""
        request = choices.first.request
        formatter = formatter_for(request, self._logprob_text, choices.first.weight_version)
        status, reason = 200, "ok"
        try:
            async with closing(choices.chunks):
                yield formatter.encode_stream(first, first=True)
                if writer is not None:
                    writer.open(choices.first, formatter)
                more = not choices.stopped(first) or await choices.after(first)
                chunks, consume, encode = choices.chunks, choices.consume, formatter.encode_stream
                stopped, after = choices.stopped, choices.after
                while more:  # per token: no coroutine but the read, no model, one write
                    item = await anext(chunks, None)
                    if item is None:
                        break
                    delta = consume(*item)
                    if events := encode(delta, False):
                        yield events
                    more = not stopped(delta) or await after(delta)
            for output in choices.outputs:
                output.check_finished()
            if request.include_usage:
                usage = formatter.usage(choices.num_completion_tokens,
                                        choices.first.num_cached_tokens,
                                        decision_of(choices.first), choices.weight_versions())
                yield sse_event(formatter.usage_event(usage))
        except Exception as exc:  # the stream has started: report in-band
            error = _log_unexpected(exc)
            status, reason = error.status_code, outcome_reason(error)
            yield sse_error(error)
        except BaseException:
            status, reason = CLIENT_CLOSED_REQUEST, CLIENT_CLOSED
            raise
        finally:
            if writer is not None:
                writer.close()
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
        """Log the request's end, record its outcome for the HTTP metrics, and settle its
        tenant's account: before the response's last bytes are written."""
        output = outputs[0]
        if status == 200:
            self._sessions.remember(output.session_id, output.decode_worker_id)
        if output.scope is not None:
            record_outcome(output.scope, status, reason)
            end_request(output.scope)
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
            completion_tokens(outputs),
            output.num_cached_tokens,
            ",".join(str(o.finish_reason) for o in outputs),
            latency_s,
        )


async def _collect(choices: Choices) -> None:
    async with closing(choices.chunks):
        async for index, chunk in choices.chunks:
            if not await choices.after(choices.consume(index, chunk)):
                break


def _log_unexpected(exc: Exception) -> APIError:
    """Map to the OpenAI error; an exception nobody planned for is a bug: log its traceback."""
    if not isinstance(exc, APIError | NoWorkerAvailableError | WorkerFailedError
                      | DeadlineExceededError | RequestRejectedError):
        logger.exception("unexpected error while serving a request")
    return to_api_error(exc)


async def _first_chunk(chunks: AsyncIterator[tuple[int, TokenChunk]]) -> tuple[int, TokenChunk]:
    item = await anext(chunks, None)
    if item is None:
        raise WorkerFailedError("the dispatcher ended the stream before any chunk")
    return item
