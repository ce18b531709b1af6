"""Output pieces -> OpenAI response objects and SSE events, per endpoint.

``ResponseFormatter`` knows the shapes; it does no I/O. Besides the request it formats,
it keeps what a stream carries from chunk to chunk per choice: a completion's text
offset for logprobs, a chat choice's tool-call parser (vLLM's, which reads deltas with
state). Both formatters are driven the same way by ``serving.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import orjson

from pdserve.core.types import TokenLogprobs
from pdserve.router.http.base import APIError
from pdserve.router.http.openai.logprobs import LogprobText, chat_entries, completion_logprobs
from pdserve.router.http.openai.preprocess import GenerationRequest
from pdserve.router.http.openai.response_schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    Envelope,
    ToolCallOut,
    Usage,
)
from pdserve.router.http.openai.tool_calls import ChoiceToolParser

SSE_DONE = b"data: [DONE]\n\n"
# The text of a template choice: its JSON string is cut out and the real text's put in.
_MARK = "@@pdserve-text@@"
_MARK_JSON = b'"' + _MARK.encode() + b'"'


def sse_event(payload: Envelope) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


def sse_error(error: APIError) -> bytes:
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


@dataclass(slots=True)
class OutputDelta:
    """What one chunk adds to one choice; ``finish_reason`` only on the chunk that ends
    it. ``context``: the choice's tokens before these (logprob texts depend on them).
    A value, never changed once made (not ``frozen``, as ``TokenChunk``: one per token)."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str | None
    index: int = 0
    logprobs: Sequence[TokenLogprobs] = ()
    prompt_logprobs: Sequence[TokenLogprobs] = ()
    context: Sequence[int] = ()


@dataclass(frozen=True)
class ChoiceOutput:
    """Everything a non-streaming response reports of one choice."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str
    index: int = 0
    logprobs: Sequence[TokenLogprobs] = ()
    prompt_logprobs: Sequence[TokenLogprobs] = ()


@dataclass(frozen=True)
class FinalOutput:
    choices: Sequence[ChoiceOutput]
    num_cached_tokens: int
    disagg: str | None = None  # "local" / "remote": where the prompt was computed
    weight_versions: list[dict[str, str | int]] | None = None  # ``Usage.weight_versions``

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)


class ResponseFormatter:
    """Shapes shared by both endpoints; subclasses build the endpoint-specific objects."""

    chunk_class: ClassVar[type[Envelope]]

    def __init__(self, request: GenerationRequest, logprob_text: LogprobText | None = None,
                 weight_version: str | None = None) -> None:
        self.request = request
        self.weight_version = weight_version
        self._logprob_text = logprob_text
        self._frame: tuple[bytes, bytes] | None = None
        self._plain: dict[int, tuple[bytes, bytes]] = {}  # per choice: see ``_render_plain``

    @property
    def top_k(self) -> int | None:
        return self.request.sampling.logprobs

    def encode_stream(self, delta: OutputDelta, first: bool) -> bytes:
        """SSE bytes for one chunk of one choice. After the request's first, every
        chunk's envelope is the same bytes: they are rendered once, and only the choice
        is serialized (the envelope's field-omitting serializer made pydantic call back
        into Python per chunk). The usual chunk, text alone, takes the fast path
        (``_plain``): pre-rendered bytes around the text's JSON, no model at all."""
        if not first and self._is_plain(delta):
            if not delta.text:
                return b""  # nothing new to say
            frame = self._plain.get(delta.index) or self._render_plain(delta.index)
            return frame[0] + orjson.dumps(delta.text) + frame[1]
        events = self.stream_events(delta, first)
        if first:
            return b"".join(sse_event(event) for event in events)
        head, tail = self._frame or self._render_frame()
        return b"".join(head + event.choices[0].model_dump_json().encode() + tail
                        for event in events)

    def _is_plain(self, delta: OutputDelta) -> bool:
        """Whether ``delta``'s chunk is the text alone: a choice already opened, not its
        last chunk, no logprobs, no token ids, no tool parser (subclasses say more)."""
        return delta.finish_reason is None and self.streams_plain()

    def streams_plain(self) -> bool:
        """Whether every chunk of an opened choice but its last is the text alone."""
        return self.top_k is None and not self.request.return_token_ids

    def plain_frame(self, index: int) -> tuple[bytes, bytes] | None:
        """The bytes before and after the text's JSON string of every later plain chunk
        of choice ``index`` (what ``encode_stream`` writes for it), once that choice has
        opened; None where its later chunks are not all plain."""
        if not self._is_plain(OutputDelta("", [], None, index)):
            return None
        return self._plain.get(index) or self._render_plain(index)

    def _render_plain(self, index: int) -> tuple[bytes, bytes]:
        """The SSE bytes before and after a plain chunk's text, for choice ``index``: a
        template chunk rendered by the slow path's own models, cut at the text."""
        head, tail = self._frame or self._render_frame()
        choice = self._plain_choice(index, _MARK).model_dump_json().encode()
        before, marker, after = choice.partition(_MARK_JSON)
        if not marker:
            raise RuntimeError("plain chunk template without its text")
        self._plain[index] = (head + before, after + tail)
        return self._plain[index]

    def _plain_choice(self, index: int, text: str) -> Any:
        raise NotImplementedError

    def _render_frame(self) -> tuple[bytes, bytes]:
        """The SSE bytes before and after a later chunk's one choice, by pydantic itself."""
        template = self.chunk_class(choices=[], **self._envelope()).model_dump_json().encode()
        head, marker, tail = template.partition(b'"choices":[]')
        if not marker:
            raise RuntimeError("chunk envelope without a choices list")
        self._frame = (b"data: " + head + b'"choices":[', b"]" + tail + b"\n\n")
        return self._frame

    def usage(self, num_completion_tokens: int, num_cached_tokens: int,
              disagg: str | None = None,
              weight_versions: list[dict[str, str | int]] | None = None) -> Usage:
        num_prompt = len(self.request.prompt_token_ids)
        return Usage.of(num_prompt, num_completion_tokens, num_cached_tokens, disagg,
                        weight_versions)

    def response(self, output: FinalOutput) -> Envelope:
        raise NotImplementedError

    def stream_events(self, delta: OutputDelta, first: bool) -> list[Envelope]:
        """Chunks for one chunk of one choice (maybe none: nothing new to say)."""
        raise NotImplementedError

    def usage_event(self, usage: Usage) -> Envelope:
        """The last chunk with ``include_usage``: no choices, the usage."""
        fields = self._envelope()
        fields["usage"] = usage
        return self.chunk_class(choices=[], **fields)

    def _envelope(self, first: bool = False) -> dict[str, Any]:
        """Common top-level fields. Optional ones are passed only when they must appear."""
        fields: dict[str, Any] = {
            "id": self.request.response_id or self.request.request_id,
            "created": self.request.created,
            "model": self.request.model,
        }
        if self.weight_version:
            fields["system_fingerprint"] = self.weight_version
        if self.request.include_usage:
            fields["usage"] = None
        if first and self.request.return_token_ids:
            fields["prompt_token_ids"] = list(self.request.prompt_token_ids)
        return fields

    def _token_ids(self, token_ids: Sequence[int]) -> dict[str, Any]:
        return {"token_ids": list(token_ids)} if self.request.return_token_ids else {}

    def _has_news(self, text: str, token_ids: Sequence[int]) -> bool:
        return bool(text) or (self.request.return_token_ids and bool(token_ids))

    def _text(self) -> LogprobText:
        if self._logprob_text is None:
            raise RuntimeError("logprobs asked for without a tokenizer to write them")
        return self._logprob_text


class CompletionFormatter(ResponseFormatter):
    chunk_class = CompletionChunk

    def __init__(self, request: GenerationRequest, logprob_text: LogprobText | None = None,
                 weight_version: str | None = None) -> None:
        super().__init__(request, logprob_text, weight_version)
        self._offsets: dict[int, int] = {}  # per choice: text offset of its next token
        self._started: set[int] = set()
        # The prompt's logprobs (echo), from choice 0, which computed the prompt: the
        # other choices reuse its KV and echo the same prompt.
        self._prompt_logprobs: Sequence[TokenLogprobs] = ()

    def response(self, output: FinalOutput) -> CompletionResponse:
        echo = self.request.echo_text or ""
        choices = [CompletionChoice(
            index=c.index, text=echo + c.text, finish_reason=c.finish_reason,
            logprobs=self._logprobs(c.index, output.choices[0].prompt_logprobs, c.logprobs, ()),
            **self._token_ids(c.token_ids)) for c in output.choices]
        fields = self._envelope(first=True)
        fields["usage"] = self.usage(output.completion_tokens, output.num_cached_tokens,
                                     output.disagg, output.weight_versions)
        return CompletionResponse(choices=choices, **fields)

    def _is_plain(self, delta: OutputDelta) -> bool:
        return delta.index in self._started and super()._is_plain(delta)

    def _plain_choice(self, index: int, text: str) -> CompletionChoice:
        return CompletionChoice(index=index, text=text, finish_reason=None, logprobs=None)

    def stream_events(self, delta: OutputDelta, first: bool) -> list[Envelope]:
        opening = delta.index not in self._started
        self._started.add(delta.index)
        text = delta.text
        if opening and self.request.echo_text is not None:
            text = self.request.echo_text + text
        # A choice's first chunk goes out even when empty: clients time the first token
        # on it.
        if not (opening or delta.finish_reason or self._has_news(text, delta.token_ids)):
            return []
        if delta.prompt_logprobs:
            self._prompt_logprobs = delta.prompt_logprobs
        prompt = self._prompt_logprobs if opening else ()
        choice = CompletionChoice(
            index=delta.index, text=text, finish_reason=delta.finish_reason,
            logprobs=self._logprobs(delta.index, prompt, delta.logprobs, delta.context),
            **self._token_ids(delta.token_ids))
        return [self.chunk_class(choices=[choice], **self._envelope(first))]

    def _logprobs(self, index: int, prompt: Sequence[TokenLogprobs],
                  positions: Sequence[TokenLogprobs], context: Sequence[int]
                  ) -> CompletionLogprobs | None:
        """Logprobs of the prompt (with ``echo``) then of ``positions``, at the choice's
        running text offset."""
        top_k = self.top_k
        if top_k is None:
            return None
        text = self._text()
        offset = self._offsets.get(index, 0)
        result = CompletionLogprobs()
        if self.request.echo_text is not None and prompt:
            offset = completion_logprobs(result, text, prompt, (), top_k, offset,
                                         first_in_prompt=True)
        self._offsets[index] = completion_logprobs(result, text, positions, context, top_k,
                                                   offset)
        return result


class ChatFormatter(ResponseFormatter):
    chunk_class = ChatCompletionChunk

    def __init__(self, request: GenerationRequest, logprob_text: LogprobText | None = None,
                 weight_version: str | None = None) -> None:
        super().__init__(request, logprob_text, weight_version)
        self._parsers: dict[int, ChoiceToolParser] = {}  # per choice, with tools
        self._opened: set[int] = set()  # choices whose role chunk went out
        self._prompt_ids = list(request.prompt_token_ids) if request.tools else []

    def response(self, output: FinalOutput) -> ChatCompletionResponse:
        choices = [self._choice(c) for c in output.choices]
        fields = self._envelope(first=True)
        fields["usage"] = self.usage(output.completion_tokens, output.num_cached_tokens,
                                     output.disagg, output.weight_versions)
        return ChatCompletionResponse(choices=choices, **fields)

    def _choice(self, c: ChoiceOutput) -> ChatChoice:
        content: str | None = c.text
        finish_reason = c.finish_reason
        extra: dict[str, Any] = {}
        if self.request.tools is not None:
            parser = self.request.tools.parser()
            content, calls = parser.parse(c.text, list(c.token_ids))
            finish_reason = parser.finish_reason(c.finish_reason, bool(calls))
            if calls:
                extra["tool_calls"] = [ToolCallOut.model_validate(call) for call in calls]
        return ChatChoice(
            index=c.index, message=AssistantMessage(content=content, **extra),
            finish_reason=finish_reason, logprobs=self._logprobs(c.logprobs, ()),
            **self._token_ids(c.token_ids))

    def _is_plain(self, delta: OutputDelta) -> bool:
        return delta.index in self._opened and super()._is_plain(delta)

    def streams_plain(self) -> bool:
        return self.request.tools is None and super().streams_plain()

    def _plain_choice(self, index: int, text: str) -> ChatStreamChoice:
        return ChatStreamChoice(index=index, delta=ChatDelta(content=text), finish_reason=None)

    def stream_events(self, delta: OutputDelta, first: bool) -> list[Envelope]:
        events: list[Envelope] = []
        parser = self._parser(delta.index)
        if delta.index not in self._opened:
            self._opened.add(delta.index)
            role = ChatDelta(role="assistant", content="")
            events.append(self._delta_chunk(delta.index, role, None, (), first=first))
            first = False
        logprobs = self._logprobs(delta.logprobs, delta.context)
        message = self._message(delta, parser)
        if message is not None or logprobs is not None:
            events.append(self._delta_chunk(delta.index, message or ChatDelta(), None,
                                            delta.token_ids, logprobs, first=first))
            first = False
        if delta.finish_reason is not None:
            reason = delta.finish_reason if parser is None else parser.finish_reason(
                delta.finish_reason, parser.streamed_calls)
            events.append(self._delta_chunk(delta.index, ChatDelta(), reason, (),
                                            first=first))
        return events

    def _parser(self, index: int) -> ChoiceToolParser | None:
        if self.request.tools is None:
            return None
        if index not in self._parsers:
            self._parsers[index] = self.request.tools.parser()
        return self._parsers[index]

    def _message(self, delta: OutputDelta, parser: ChoiceToolParser | None
                 ) -> ChatDelta | None:
        if parser is not None:
            fields = parser.delta(delta.text, list(delta.token_ids), self._prompt_ids,
                                  finished=delta.finish_reason is not None)
            return None if fields is None else ChatDelta(**fields)
        if self._has_news(delta.text, delta.token_ids):
            return ChatDelta(content=delta.text)
        return None

    def _logprobs(self, positions: Sequence[TokenLogprobs], context: Sequence[int]
                  ) -> ChatLogprobs | None:
        if self.top_k is None:
            return None
        return ChatLogprobs(content=chat_entries(self._text(), positions, context, self.top_k))

    def _delta_chunk(
        self, index: int, delta: ChatDelta, finish_reason: str | None,
        token_ids: Sequence[int], logprobs: ChatLogprobs | None = None, first: bool = False,
    ) -> ChatCompletionChunk:
        choice = ChatStreamChoice(index=index, delta=delta, finish_reason=finish_reason,
                                  logprobs=logprobs, **self._token_ids(token_ids))
        return self.chunk_class(choices=[choice], **self._envelope(first))


def formatter_for(request: GenerationRequest, logprob_text: LogprobText | None = None,
                  weight_version: str | None = None) -> ResponseFormatter:
    """``weight_version``: the response's ``system_fingerprint`` (None: none)."""
    if request.endpoint == "chat":
        return ChatFormatter(request, logprob_text, weight_version)
    return CompletionFormatter(request, logprob_text, weight_version)
