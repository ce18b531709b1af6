"""OpenAI response models for ``/v1/completions`` and ``/v1/chat/completions``, and the
error body. Field order is the JSON's."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    model_serializer,
)


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
    """OpenAI's usage, plus pdserve's extensions ``pdserve_disagg`` ("local": decode
    computed the prompt; "remote": a prefill worker did and handed over the KV), present
    only when the dispatcher reported it, and ``weight_versions``: the weights version
    of each span of the completion's tokens (``{"version", "start", "end"}``, token
    offsets in the choice's completion, end exclusive; ``"index"`` names the choice
    when ``n`` > 1), present when the workers named their version."""

    _omit_unless_set = frozenset({"pdserve_disagg", "weight_versions"})
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]
    pdserve_disagg: str | None = None
    weight_versions: list[dict[str, str | int]] | None = None

    @classmethod
    def of(cls, num_prompt: int, num_completion: int, num_cached: int,
           disagg: str | None = None,
           weight_versions: list[dict[str, str | int]] | None = None) -> Usage:
        extension: dict[str, Any] = {} if disagg is None else {"pdserve_disagg": disagg}
        if weight_versions:
            extension["weight_versions"] = weight_versions
        return cls(
            prompt_tokens=num_prompt,
            completion_tokens=num_completion,
            total_tokens=num_prompt + num_completion,
            prompt_tokens_details={"cached_tokens": num_cached},
            **extension,
        )


class CompletionLogprobs(BaseModel):
    """The legacy endpoint's logprobs: per token its text, offset in the choice's text,
    logprob (None for the prompt's first token) and top candidates by text."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class LogprobContent(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[LogprobContent] | None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(_Response):
    """``tool_calls`` appears only when calls were made."""

    _omit_unless_set = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatDelta(_Response):
    """``tool_calls`` deltas are vLLM's parser's (``index``, then ``id``/``type``/
    ``function.name`` once, then ``function.arguments`` pieces)."""

    _omit_unless_set = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatStreamChoice(_Response):
    _omit_unless_set = frozenset({"token_ids"})
    index: int = 0
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class Envelope(_Response):
    """Top level of every response and chunk; subclasses narrow ``object`` and ``choices``
    (overriding keeps this field order in the JSON)."""

    _omit_unless_set = frozenset({"usage", "prompt_token_ids", "system_fingerprint"})
    id: str
    object: str
    created: int
    model: str
    # The weights version that produced every token of the response (OpenAI's field
    # for the backend's configuration).
    system_fingerprint: str | None = None
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
