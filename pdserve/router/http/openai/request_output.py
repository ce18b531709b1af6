"""One request's output as the dispatcher's chunks arrive: per choice
(``RequestOutput``: text, stop strings, finish reason, logprobs, metrics), and for all
its choices (``Choices``: OpenAI's ``n``)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from urllib.parse import quote

from starlette.types import Scope

from pdserve.core.types import TokenLogprobs
from pdserve.router.dispatch.base import TokenChunk, WorkerFailedError
from pdserve.router.dispatch.policies.disagg import DisaggDecision
from pdserve.router.http.openai.choices import ChoiceStreams
from pdserve.router.http.openai.detokenize import IncrementalDetokenizer, TokenDecoder
from pdserve.router.http.openai.logprobs import CONTEXT_TOKENS
from pdserve.router.http.openai.preprocess import GenerationRequest
from pdserve.router.http.openai.responses import ChoiceOutput, FinalOutput, OutputDelta
from pdserve.router.metrics import RouterMetrics

WEIGHT_VERSION_HEADER = "x-weight-version"  # the weights that produced the response
# What a header value may hold as is: printable ASCII but "%" (the rest is percent-encoded).
_HEADER_SAFE = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")
# "<local|remote>; reason=<rule>", the rules in router/dispatch/policies/disagg.py
DISAGG_HEADER = "x-pdserve-disagg"


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
        self.weight_version: str | None = None  # from the first chunk
        # [version, start, end, adapter tag or ""] of each run of tokens one version
        # (and one adapter folder) produced (a kept request that crossed a refit has two).
        self.weight_spans: list[list[str | int]] = []
        self.session_id: str | None = None  # ``X-Session-ID`` (``sessions.py``)
        self.decode_worker_id: str | None = None  # the last decode worker that generated
        self.logprobs: list[TokenLogprobs] = []
        self.prompt_logprobs: tuple[TokenLogprobs, ...] = ()
        self._texts: list[str] = []
        self._metrics = metrics
        self._tokens = metrics.tokens  # None: metrics off (not even a clock read per chunk)
        self._started = False  # the first chunk came
        self._last_chunk_s = 0.0  # when (``perf_counter``), with metrics on
        self._no_stop_strings = not request.stop

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
        """Add a chunk; chunks after the end (there should be none) add nothing. Every
        chunk of every response passes here once, whether the body's loop or the stream
        writer (``stream_writer.py``) takes it."""
        if not self._started:
            self._observe_first(chunk)
        elif self._tokens is not None:
            self._last_chunk_s = self._tokens.chunk(self._last_chunk_s, len(chunk.token_ids))
        if chunk.decode_worker_id is not None:
            self.decode_worker_id = chunk.decode_worker_id
        if self.finish_reason is not None:
            return OutputDelta("", [], None, self.index)
        if chunk.plain and self._no_stop_strings:
            # Tokens alone, no stop string to look for (the usual chunk): the text step
            # below without the finish, stop or logprobs to handle.
            text = self.detokenizer.add(chunk.token_ids)
            self._texts.append(text)
            self._span(None, len(chunk.token_ids))
            return OutputDelta(text, chunk.token_ids, None, self.index)
        finish, token_ids, detokenizer = chunk.finish_reason, chunk.token_ids, self.detokenizer
        before = len(detokenizer.token_ids)
        if finish is None:
            text = detokenizer.add(token_ids)
        else:
            if finish in ("error", "abort") and not chunk.ended_by_update:
                raise WorkerFailedError(f"the workers ended the request ({finish})")
            # An engine's "stop" is a stop token (end of sequence, stop_token_ids; stop
            # strings are the router's own): counted, its text not output, as in vLLM.
            last_stops = (finish == "stop" and bool(token_ids)
                          and token_ids[-1] in self.request.stop_token_set)
            text = detokenizer.add(token_ids, last_stops=last_stops)
            if not detokenizer.stopped:
                text += detokenizer.finish()
            self.finish_reason = finish
        if detokenizer.stopped:
            self.finish_reason = "stop"
        self._texts.append(text)
        num_new = len(detokenizer.token_ids) - before  # fewer than sent past a stop string
        new_ids = token_ids if num_new == len(token_ids) else detokenizer.token_ids[before:]
        self._span(chunk.weight_version, num_new, chunk.adapter)
        if not chunk.logprobs and not chunk.prompt_logprobs:
            return OutputDelta(text, new_ids, self.finish_reason, self.index)
        positions = chunk.logprobs[:num_new]
        self.logprobs.extend(positions)
        if chunk.prompt_logprobs:
            self.prompt_logprobs = chunk.prompt_logprobs
        # The tokens before (logprob texts depend on them), copied only when asked for.
        context = detokenizer.token_ids[max(before - CONTEXT_TOKENS, 0):before] if positions else ()
        return OutputDelta(text, new_ids, self.finish_reason, self.index, positions,
                           chunk.prompt_logprobs, context)

    def _span(self, version: str | None, num_tokens: int, adapter: str | None = None) -> None:
        """``num_tokens`` more tokens, of ``version`` and adapter folder ``adapter``
        (None: the last span's)."""
        spans = self.weight_spans
        if spans and (version or spans[-1][0]) == spans[-1][0] and (
                adapter or spans[-1][3]) == spans[-1][3]:
            spans[-1][2] = int(spans[-1][2]) + num_tokens
            return
        if version is None and not spans:
            return  # no worker named a version
        end = int(spans[-1][2]) if spans else 0
        spans.append([version or spans[-1][0], end, end + num_tokens,
                      adapter or (spans[-1][3] if spans else "")])

    def final(self) -> ChoiceOutput:
        return ChoiceOutput(self.text, self.token_ids, self.check_finished(), self.index,
                            self.logprobs, self.prompt_logprobs)

    def headers(self) -> dict[str, str]:
        """The disaggregation decision, known from the first chunk on (before any byte of
        the body), as a header on streaming and non-streaming responses alike."""
        headers = {} if self.disagg is None else {DISAGG_HEADER: self.disagg.header()}
        if self.weight_version:
            # A version is the admin's text (or a folder's name): one that is not printable
            # ASCII would fail every response's headers (a 500), so it is percent-encoded.
            headers[WEIGHT_VERSION_HEADER] = quote(self.weight_version, safe=_HEADER_SAFE)
        return headers

    def check_finished(self) -> str:
        if self.finish_reason is None:
            raise WorkerFailedError("the dispatcher ended the stream without a finish reason")
        return self.finish_reason

    def _observe_first(self, chunk: TokenChunk) -> None:
        """The first chunk: what it says of the request, the time to first token."""
        self.num_cached_tokens = chunk.num_cached_tokens or 0
        self.disagg = chunk.disagg
        self.weight_version = chunk.weight_version
        self._started = True
        if self._tokens is None:
            return
        now = time.perf_counter()
        if self.index == 0:
            self._metrics.time_to_first_token.observe(now - self.request.arrival_s)
        self._last_chunk_s = now
        self._tokens.count(len(chunk.token_ids))


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

    def consume(self, index: int, chunk: TokenChunk) -> OutputDelta:
        return self.outputs[index].consume(chunk)

    def stopped(self, delta: OutputDelta) -> bool:
        """Whether ``delta``'s choice just ended by its stop string (then ``after``)."""
        return self.outputs[delta.index].stopped_by_string

    async def after(self, delta: OutputDelta) -> bool:
        """Whether to read on after ``delta``. A choice ended by its stop string is closed
        (its workers abort it): with one choice, that is the request (stop reading, the
        caller closes the stream); with several, that choice alone, and the others are
        read to their own end."""
        output = self.outputs[delta.index]
        if not output.stopped_by_string:
            return True
        if self._streams is None:
            return False
        await self._streams.close_choice(delta.index)
        return True

    def final(self) -> FinalOutput:
        return FinalOutput([o.final() for o in self.outputs], self.first.num_cached_tokens,
                           decision_of(self.first), self.weight_versions())

    def weight_versions(self) -> list[dict[str, str | int]] | None:
        """``usage.weight_versions``: each choice's spans (with its index when ``n`` > 1);
        None when no worker named a version."""
        many = len(self.outputs) > 1
        spans = [{"version": v, "start": s, "end": e, **({"lora": a} if a else {}),
                  **({"index": o.index} if many else {})}
                 for o in self.outputs for v, s, e, a in o.weight_spans]
        return spans or None

    @property
    def num_completion_tokens(self) -> int:
        return completion_tokens(self.outputs)


def completion_tokens(outputs: Sequence[RequestOutput]) -> int:
    return sum(len(o.token_ids) for o in outputs)


def decision_of(output: RequestOutput) -> str | None:
    """Where the prompt was computed ("local"/"remote"), for the usage extension."""
    return None if output.disagg is None else output.disagg.decision
