"""OpenAI request and response models for ``/v1/completions`` and ``/v1/chat/completions``.

Requests are validated here, field by field, so that every rejection names the offending
field (it becomes ``error.param``). Cross-field checks that need the tokenizer (context
length, token id range) live in ``preprocess.py``. Unknown fields are ignored: OpenAI clients
send extras this server does not know.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

MAX_STOP_STRINGS = 4

# Ranges of the protobuf fields these values travel in (proto/pdserve/v1/worker.proto):
# out of range they would fail in the conversion, a 500, instead of a 400 naming the field.
UINT32_MAX = 2**32 - 1
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Parameters this server does not implement, with the values that mean "not used".
# Anything else is rejected with the parameter's name rather than silently ignored.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[object, ...]] = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "logit_bias": (None, {}),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}


def _is_default(value: object, defaults: tuple[object, ...]) -> bool:
    # Compare types too: in Python 1 == True and 0 == False.
    return any(value is d or (type(value) is type(d) and value == d) for d in defaults)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(BaseModel):
    """Fields shared by both endpoints. ``stream`` precedes ``stream_options`` on purpose:
    the latter's validator reads the former."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str
    max_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    user: str | None = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = None
    logit_bias: Any = None
    best_of: Any = None
    suffix: Any = None
    tools: Any = None
    response_format: Any = None

    @field_validator(*_UNSUPPORTED_DEFAULTS)
    @classmethod
    def _reject_unsupported(cls, value: object, info: ValidationInfo) -> object:
        if not _is_default(value, _UNSUPPORTED_DEFAULTS[str(info.field_name)]):
            raise ValueError("not supported by this server")
        return value

    @field_validator("top_k")
    @classmethod
    def _check_top_k(cls, value: int | None) -> int | None:
        if value is not None and value < -1:
            raise ValueError("must be -1 or 0 (disabled), or at least 1")
        return value

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _check_n(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("only n=1 is supported")
        return value

    @field_validator("stream_options")
    @classmethod
    def _check_stream_options(
        cls, value: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed when stream is true")
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    """``prompt`` is one string or one list of token ids (a one-string list is unwrapped)."""

    prompt: str | list[int]

    @field_validator("prompt", mode="before")
    @classmethod
    def _single_prompt(cls, value: object) -> object:
        if isinstance(value, list) and value and all(isinstance(p, str) for p in value):
            if len(value) > 1:
                raise ValueError("only one prompt per request is supported")
            return value[0]
        if isinstance(value, list) and value and isinstance(value[0], list):
            raise ValueError("only one prompt per request is supported")
        return value


class ContentPart(BaseModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text":
            raise ValueError(f"content part type '{self.type}' is not supported, only 'text'")
        if self.text is None:
            raise ValueError("a 'text' content part needs a 'text' field")
        return self


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        # Same flattening as vLLM's "string" content format: parts joined by newlines.
        return "\n".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current OpenAI name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


# --- responses ---------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every error status (``errors.py`` renders it)."""

    error: ErrorDetail


class _Response(BaseModel):
    """Fields in ``_omit_unless_set`` appear only when explicitly given (``usage: null`` in
    chunks with ``include_usage``, the ``return_token_ids`` extension, chat deltas)."""

    _omit_unless_set: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _omit(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> Any:
        data = handler(self)
        for name in self._omit_unless_set - self.model_fields_set:
            data.pop(name, None)
        return data


class Usage(_Response):
    """OpenAI's usage, plus pdserve's extension ``pdserve_disagg`` ("local": decode
    computed the prompt; "remote": a prefill worker did and handed over the KV), present
    only when the dispatcher reported it."""

    _omit_unless_set = frozenset({"pdserve_disagg"})
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    pdserve_disagg: str | None = None

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int,
           disagg: str | None = None) -> Usage:
        extension = {} if disagg is None else {"pdserve_disagg": disagg}
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details={"cached_tokens": num_cached},
            **extension,
        )


class CompletionChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class ChatDelta(_Response):
    _omit_unless_set = frozenset({"role", "content"})
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: None = None
    token_ids: list[int] | None = None


class Envelope(_Response):
    """Top level of every response and chunk; subclasses narrow ``object`` and ``choices``
    (overriding keeps this field order in the JSON)."""

    _omit_unless_set = frozenset({"usage", "prompt_token_ids"})
    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionResponse(Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]


class CompletionChunk(Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(Envelope):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
