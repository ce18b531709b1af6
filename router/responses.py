"""Output pieces -> OpenAI response objects and SSE events, per endpoint.

``ResponseFormatter`` knows the shapes; it does no I/O and keeps no state besides the
request it formats, so both formatters are driven the same way by ``serving.py``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from .errors import APIError
from .preprocess import GenerationRequest
from .schemas import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatStreamChoice,
    CompletionChoice,
    CompletionChunk,
    CompletionResponse,
    Envelope,
    Usage,
)

SSE_DONE = b"data: [DONE]\n\n"


def sse_event(payload: Envelope) -> bytes:
    return b"data: " + payload.model_dump_json().encode() + b"\n\n"


def sse_error(error: APIError) -> bytes:
    return b"data: " + json.dumps(error.body()).encode() + b"\n\n"


@dataclass(frozen=True)
class FinalOutput:
    """Everything a non-streaming response reports."""

    text: str
    token_ids: Sequence[int]
    finish_reason: str
    num_cached_tokens: int
    disagg: str | None = None  # "local" / "remote": where the prompt was computed


class ResponseFormatter:
    """Shapes shared by both endpoints; subclasses build the endpoint-specific objects."""

    chunk_class: ClassVar[type[Envelope]]

    def __init__(self, request: GenerationRequest) -> None:
        self.request = request
        self._frame: tuple[bytes, bytes] | None = None

    def encode_stream(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None, first: bool
    ) -> bytes:
        """SSE bytes for one dispatcher chunk. After the first, every chunk's envelope is
        the same bytes: they are rendered once, and only the choice is serialized (the
        envelope's field-omitting serializer made pydantic call back into Python per chunk)."""
        events = self.stream_events(text, token_ids, finish_reason, first)
        if first:
            return b"".join(sse_event(event) for event in events)
        head, tail = self._frame or self._render_frame()
        return b"".join(head + event.choices[0].model_dump_json().encode() + tail
                        for event in events)

    def _render_frame(self) -> tuple[bytes, bytes]:
        """The SSE bytes before and after a later chunk's one choice, by pydantic itself."""
        template = self.chunk_class(choices=[], **self._envelope()).model_dump_json().encode()
        head, marker, tail = template.partition(b'"choices":[]')
        if not marker:
            raise RuntimeError("chunk envelope without a choices list")
        self._frame = (b"data: " + head + b'"choices":[', b"]" + tail + b"\n\n")
        return self._frame

    def usage(self, num_completion_tokens: int, num_cached_tokens: int,
              disagg: str | None = None) -> Usage:
        num_prompt = len(self.request.prompt_token_ids)
        return Usage.of(num_prompt, num_completion_tokens, num_cached_tokens, disagg)

    def response(self, output: FinalOutput) -> Envelope:
        raise NotImplementedError

    def stream_events(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None, first: bool
    ) -> list[Envelope]:
        """Chunks for one dispatcher chunk's output (maybe none: nothing new to say)."""
        raise NotImplementedError

    def usage_event(self, usage: Usage) -> Envelope:
        """The last chunk with ``include_usage``: no choices, the usage."""
        fields = self._envelope()
        fields["usage"] = usage
        return self.chunk_class(choices=[], **fields)

    def _envelope(self, first: bool = False) -> dict[str, Any]:
        """Common top-level fields. Optional ones are passed only when they must appear."""
        fields: dict[str, Any] = {
            "id": self.request.request_id,
            "created": self.request.created,
            "model": self.request.model,
        }
        if self.request.include_usage:
            fields["usage"] = None
        if first and self.request.return_token_ids:
            fields["prompt_token_ids"] = list(self.request.prompt_token_ids)
        return fields

    def _token_ids(self, token_ids: Sequence[int]) -> dict[str, Any]:
        return {"token_ids": list(token_ids)} if self.request.return_token_ids else {}

    def _has_news(self, text: str, token_ids: Sequence[int]) -> bool:
        return bool(text) or (self.request.return_token_ids and bool(token_ids))


class CompletionFormatter(ResponseFormatter):
    chunk_class = CompletionChunk

    def response(self, output: FinalOutput) -> CompletionResponse:
        choice = CompletionChoice(
            text=output.text,
            finish_reason=output.finish_reason,
            **self._token_ids(output.token_ids),
        )
        fields = self._envelope(first=True)
        fields["usage"] = self.usage(len(output.token_ids), output.num_cached_tokens,
                                     output.disagg)
        return CompletionResponse(choices=[choice], **fields)

    def stream_events(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None, first: bool
    ) -> list[Envelope]:
        # The first chunk goes out even when empty: clients time the first token on it.
        if not (first or finish_reason or self._has_news(text, token_ids)):
            return []
        choice = CompletionChoice(
            text=text, finish_reason=finish_reason, **self._token_ids(token_ids)
        )
        return [self.chunk_class(choices=[choice], **self._envelope(first))]


class ChatFormatter(ResponseFormatter):
    chunk_class = ChatCompletionChunk

    def response(self, output: FinalOutput) -> ChatCompletionResponse:
        choice = ChatChoice(
            message=AssistantMessage(content=output.text),
            finish_reason=output.finish_reason,
            **self._token_ids(output.token_ids),
        )
        fields = self._envelope(first=True)
        fields["usage"] = self.usage(len(output.token_ids), output.num_cached_tokens,
                                     output.disagg)
        return ChatCompletionResponse(choices=[choice], **fields)

    def stream_events(
        self, text: str, token_ids: Sequence[int], finish_reason: str | None, first: bool
    ) -> list[Envelope]:
        events: list[Envelope] = []
        if first:
            role = ChatDelta(role="assistant", content="")
            events.append(self._delta_chunk(role, None, (), first=True))
        if self._has_news(text, token_ids):
            events.append(self._delta_chunk(ChatDelta(content=text), None, token_ids))
        if finish_reason is not None:
            events.append(self._delta_chunk(ChatDelta(), finish_reason, ()))
        return events

    def _delta_chunk(
        self,
        delta: ChatDelta,
        finish_reason: str | None,
        token_ids: Sequence[int],
        first: bool = False,
    ) -> ChatCompletionChunk:
        choice = ChatStreamChoice(
            delta=delta, finish_reason=finish_reason, **self._token_ids(token_ids)
        )
        return self.chunk_class(choices=[choice], **self._envelope(first))


def formatter_for(request: GenerationRequest) -> ResponseFormatter:
    if request.endpoint == "chat":
        return ChatFormatter(request)
    return CompletionFormatter(request)
