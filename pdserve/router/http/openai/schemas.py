"""OpenAI request models for ``/v1/completions`` and ``/v1/chat/completions`` (the
responses are in ``response_schemas.py``).

Requests are validated here, field by field, so that every rejection names the offending
field (it becomes ``error.param``). Cross-field checks that need the tokenizer (context
length, token id range) live in ``preprocess.py``. Unknown fields are ignored: OpenAI clients
send extras this server does not know.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pdserve.router.http.openai.structured import ResponseFormat, StructuredOutputsParam
from pdserve.router.http.openai.tool_calls import (
    MessageToolCall,
    NamedToolChoice,
    Tool,
    ToolChoice,
    check_tool_choice,
)

MAX_STOP_STRINGS = 4

# Ranges of the protobuf fields these values travel in (proto/pdserve/v1/worker.proto):
# out of range they would fail in the conversion, a 500, instead of a 400 naming the field.
UINT32_MAX = 2**32 - 1
_UINT32_DIGITS = len(str(UINT32_MAX))
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Parameters this server does not implement, with the values that mean "not used".
# Anything else is rejected with the parameter's name rather than silently ignored.
_UNSUPPORTED_DEFAULTS: dict[str, tuple[object, ...]] = {
    # vLLM 0.32's V1 engine has no best_of (``vllm serve`` ignores it): refused, not
    # ignored, so a client never believes it got the best of several samples.
    "best_of": (None, 1),
    "suffix": (None, ""),
    # vLLM's extensions that pdserve does not carry (yet): refused by name.
    "use_beam_search": (None, False),
    "bad_words": (None, []),
    "allowed_token_ids": (None, []),
    "include_stop_str_in_output": (None, False),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    # vLLM removed them (its structured_outputs replaces them); it ignores them with a
    # warning, which would silently drop the constraint: refused here.
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
MAX_LOGPROBS = 20  # vLLM's default max_logprobs, and OpenAI's top_logprobs limit
MAX_N = 128
MAX_CACHE_SALT_LENGTH = 128  # vLLM's
CACHE_SALT_FORBIDDEN = ("@", "/", "\\", "\0")
# JSON may carry a lone UTF-16 surrogate ("\ud800"): a Python str holds it, but it is
# not text: no tokenizer, hash or UTF-8 encoder takes it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
LOGIT_BIAS_LIMIT = 100.0

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
    min_tokens: int = Field(default=0, ge=0, le=UINT32_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, le=INT32_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = Field(default=1, ge=1, le=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is not output
    user: str | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParam | None = None
    # vLLM's: requests with different salts share no cached KV (``validate_cache_salt``).
    cache_salt: str | None = None
    # Parameters this endpoint does not implement (``_reject_unsupported``).
    unsupported_fields: ClassVar[dict[str, tuple[object, ...]]] = _UNSUPPORTED_DEFAULTS

    @model_validator(mode="before")
    @classmethod
    def _reject_unsupported(cls, data: Any) -> Any:
        """A parameter this server does not implement, given a value other than one that
        means "not used", is refused by name rather than silently ignored."""
        if isinstance(data, dict):
            for name, defaults in cls.unsupported_fields.items():
                if name in data and not _is_default(data[name], defaults):
                    raise _field_error(name, "not supported by this server")
        return data

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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            # ASCII digits, at most uint32's ten: int() is then cheap and within its
            # 4,300-digit limit, and "\u0663" (a decimal to str.isdecimal) is refused.
            if not (key.isascii() and key.isdecimal() and len(key) <= _UINT32_DIGITS
                    and int(key) <= UINT32_MAX):
                raise ValueError(f"keys must be token ids, not {key[:32]!r}"
                                 + ("..." if len(key) > 32 else ""))
        # Biases beyond +-LOGIT_BIAS_LIMIT are clamped (preprocess.py), as vLLM does.
        return value

    @field_validator("cache_salt")
    @classmethod
    def _check_cache_salt(cls, value: str | None) -> str | None:
        """vLLM's rules: non-empty, at most 128 characters, none of ``@ / \\`` or NUL;
        and text (no lone surrogate)."""
        if value is not None and (not value or len(value) > MAX_CACHE_SALT_LENGTH
                                  or any(c in value for c in CACHE_SALT_FORBIDDEN)
                                  or has_lone_surrogate(value)):
            raise ValueError("must be a non-empty string of at most "
                             f"{MAX_CACHE_SALT_LENGTH} characters without '@', '/', "
                             "'\\', NUL or a lone surrogate")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _check_stop_token_ids(cls, value: list[int] | None) -> list[int] | None:
        if any(t < 0 or t > UINT32_MAX for t in value or []):
            raise ValueError("token ids must be >= 0")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> _SamplingRequest:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _field_error("min_tokens", "must not exceed max_tokens")
        if self.response_format is not None and self.structured_outputs is not None and (
                self.response_format.type != "text"):
            raise _field_error("structured_outputs",
                               "give response_format or structured_outputs, not both")
        return self

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
    """``prompt`` is one string or one list of token ids (a one-string list is unwrapped).
    ``logprobs``: the top-k per token (0: the sampled token's alone); with ``echo``, the
    prompt's too."""

    prompt: Annotated[str | list[int], WithJsonSchema({"anyOf": [  # as _single_prompt reads it
        {"type": "string"}, {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 1}],
        "title": "Prompt"})]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

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
    """A message; an assistant's may carry ``tool_calls`` (and no content), a tool's
    answers the call named by ``tool_call_id``."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _has_content(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant's message with "
                             "tool_calls may omit it)")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # Same flattening as vLLM's "string" content format: parts joined by newlines.
        return "\n".join(part.text or "" for part in self.content)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (tool calls' arguments as objects, as
        vLLM hands them to templates)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        return message


class ChatCompletionRequest(_SamplingRequest):
    """``logprobs`` with ``top_logprobs`` candidates per token; ``tools`` and
    ``tool_choice`` as OpenAI defines them (``tool_calls.py`` validates the pair)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=UINT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = True
    # vLLM's chat echo (the last message's content before the answer) is not served.
    unsupported_fields = {**_UNSUPPORTED_DEFAULTS, "echo": (None, False)}

    @model_validator(mode="after")
    def _check_chat_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise _field_error("top_logprobs",
                               "when using `top_logprobs`, `logprobs` must be set to true.")
        try:
            check_tool_choice(self.tools, self.tool_choice)
        except ValueError as exc:
            raise _field_error("tool_choice" if self.tools else "tools", str(exc)) from None
        if isinstance(self.tool_choice, NamedToolChoice) and (
                self.structured_outputs is not None or self.response_format is not None
                and self.response_format.type != "text"):
            raise _field_error("tool_choice", "You can only either use constraints for "
                               "structured outputs or tools, not both.")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (the current OpenAI name) wins over ``max_tokens``."""
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


def _field_error(param: str, message: str) -> PydanticCustomError:
    """A cross-field error that names ``param`` (``errors.py`` makes it ``error.param``)."""
    return PydanticCustomError("value_error", "{param}: {message}",
                               {"param": param, "message": message})


def has_lone_surrogate(text: str) -> bool:
    """``text`` holds a UTF-16 surrogate on its own (JSON's ``"\\ud800"``), so is not
    valid Unicode."""
    return _LONE_SURROGATE.search(text) is not None
