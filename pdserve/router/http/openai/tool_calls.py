"""Tool calling on ``/v1/chat/completions``, the way ``vllm serve`` does it, with vLLM's
own parsers.

- The request's ``tools`` go to the chat template for every ``tool_choice``.
- ``none`` (the default without tools) answers in text.
- ``auto`` (the default with tools), ``required`` and a named function need the router
  started with ``--tool-call-parser NAME`` (``auto`` also with
  ``--enable-auto-tool-choice``), the flags of ``vllm serve``. Then vLLM's parser for
  the model's format:
  - constrains the output (its structural tag or JSON schema, applied by both engines);
  - reads the finished text into ``tool_calls``, or the streamed deltas into
    ``tool_calls`` deltas.

The split: the router keeps its own light request models (no vLLM import; vLLM takes
~6 s and a few hundred MB to import). Only a router started with a tool parser loads
vLLM's parser stack, once, at start-up (``ToolCalling.load``). Each request then gets
vLLM's own request object and parser, so a model's tool format behaves exactly as in
``vllm serve``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from pdserve.core.types import StructuredOutput
from pdserve.router.http.errors import InvalidRequestError


class FunctionDefinition(BaseModel):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def for_template(self) -> dict[str, Any]:
        """As vLLM hands tools to chat templates (``strict`` dropped when unset)."""
        return self.model_dump(exclude={"function": {"strict"}} if self.function.strict is None
                               else None)


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A tool call in an assistant message the client sends back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall

    def for_template(self) -> dict[str, Any]:
        """Templates index the arguments as an object (as vLLM hands them over)."""
        call = self.model_dump(exclude_none=True)
        try:
            call["function"]["arguments"] = json.loads(self.function.arguments)
        except ValueError:
            pass  # not JSON: the template gets the text
        return call


def check_tool_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> None:
    """Raise ``ValueError`` (a 400) for tools and a choice that do not fit, with vLLM's
    words."""
    if tools is not None and not tools:
        raise ValueError("`tools` must not be an empty array. Either provide at least one "
                         "tool or omit the field entirely.")
    if choice is None or choice == "none":
        return
    if not tools:
        raise ValueError("When using `tool_choice`, `tools` must be set.")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in (
            tool.function.name for tool in tools):
        raise ValueError("The tool specified in `tool_choice` does not match any of the "
                         "specified `tools`")


def effective_choice(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: ``auto`` with tools, ``none`` without."""
    if choice is not None:
        return choice
    return "auto" if tools else "none"


@dataclass(frozen=True)
class ToolConfig:
    """``--tool-call-parser`` and ``--enable-auto-tool-choice``, as ``vllm serve``."""

    parser: str | None = None
    enable_auto: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto and not self.parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")


class ToolCalling:
    """vLLM's parser class for the configured tool format, over the router's tokenizer."""

    def __init__(self, config: ToolConfig, parser_cls: Any, tokenizer: Any) -> None:
        self.config = config
        self._parser_cls = parser_cls
        self._tokenizer = tokenizer

    @classmethod
    def load(cls, config: ToolConfig, tokenizer: Any) -> ToolCalling | None:
        """Import vLLM's parsers (None without ``--tool-call-parser``). An unknown parser
        name fails here, listing the known ones."""
        if not config.parser:
            return None
        from vllm.parser.parser_manager import ParserManager
        from vllm.tool_parsers import ToolParserManager

        known = sorted(ToolParserManager.list_registered())
        if config.parser not in known:
            raise ValueError(f"unknown --tool-call-parser {config.parser!r}; "
                             f"known: {', '.join(known)}")
        parser_cls = ParserManager.get_parser(tool_parser_name=config.parser,
                                              enable_auto_tools=config.enable_auto,
                                              tokenizer=tokenizer)
        return cls(config, parser_cls, tokenizer)

    def check(self, choice: ToolChoice) -> None:
        if choice == "auto" and not self.config.enable_auto:
            raise no_tool_parser_error(choice)

    def session(self, body: dict[str, Any]) -> ToolSession:
        """The request as vLLM's own request object, adjusted by its parser (the output
        constraint for the choice)."""
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        request = ChatCompletionRequest.model_validate(body)
        parser = self._parser_cls(self._tokenizer, request.tools)
        if request.tool_choice != "none" or parser.always_adjust_request:
            request = parser.adjust_request(request)
        return ToolSession(self._parser_cls, self._tokenizer, request)


def no_tool_parser_error(choice: ToolChoice) -> InvalidRequestError:
    """vLLM's refusal of a tool choice on a server without a tool parser."""
    if choice == "auto":
        return InvalidRequestError('"auto" tool choice requires --enable-auto-tool-choice and '
                                   "--tool-call-parser to be set", param="tool_choice")
    name = (f'function "{choice.function.name}"' if isinstance(choice, NamedToolChoice)
            else f'"{choice}"')
    return InvalidRequestError(f"tool_choice={name} requires --tool-call-parser to be set",
                               param="tool_choice")


class ToolSession:
    """One request's vLLM request object; ``parser()`` gives a fresh vLLM parser per
    choice (a streaming parser keeps state)."""

    def __init__(self, parser_cls: Any, tokenizer: Any, request: Any) -> None:
        self._parser_cls = parser_cls
        self._tokenizer = tokenizer
        self.request = request

    @property
    def named(self) -> bool:
        return not isinstance(self.request.tool_choice, str)

    @property
    def choice(self) -> str:
        return "named" if self.named else str(self.request.tool_choice)

    @property
    def skip_special_tokens(self) -> bool:
        return bool(self.request.skip_special_tokens)

    def structured(self) -> StructuredOutput | None:
        """The constraint vLLM's parser put on the output (None: free text)."""
        params = self.request.structured_outputs
        if params is None:
            return None
        if params.structural_tag is not None:
            return StructuredOutput("structural_tag", params.structural_tag)
        if params.json is not None:
            schema = params.json
            return StructuredOutput("json", schema if isinstance(schema, str)
                                    else json.dumps(schema))
        return None

    def parser(self) -> ChoiceToolParser:
        return ChoiceToolParser(self, self._parser_cls(self._tokenizer, self.request.tools))


class ChoiceToolParser:
    """vLLM's parser over one choice's output: the whole text, or its deltas."""

    def __init__(self, session: ToolSession, parser: Any) -> None:
        self._session = session
        self._parser = parser
        self.streamed_calls = False

    def parse(self, text: str, token_ids: list[int]) -> tuple[str | None, list[dict[str, Any]]]:
        """``(content, tool_calls)`` of a finished output, as vLLM's message has them."""
        from vllm.renderers.chat_utils import make_tool_call_id

        request = self._session.request
        if request.tool_choice == "none":
            return text, []
        _, content, calls = self._parser.parse(text, request, enable_auto_tools=True,
                                               model_output_token_ids=token_ids)
        tool_calls = [{"id": call.id or make_tool_call_id(), "type": "function",
                       "function": {"name": call.name, "arguments": call.arguments}}
                      for call in calls or []]
        if request.parallel_tool_calls is False:
            tool_calls = tool_calls[:1]
        if self._session.choice in ("named", "required"):
            content = content or ""
        return content, tool_calls

    def delta(self, text: str, token_ids: list[int], prompt_token_ids: list[int],
              finished: bool) -> dict[str, Any] | None:
        """The chat delta for one piece of output (None: nothing to send yet)."""
        request = self._session.request
        if request.tool_choice == "none":
            return {"content": text} if text else None
        message = self._parser.parse_delta(text, token_ids, request, prompt_token_ids,
                                           finished=finished)
        if message is None:
            return None
        delta = message.model_dump(exclude_unset=True, include={"content", "tool_calls"})
        if request.parallel_tool_calls is False and delta.get("tool_calls"):
            delta["tool_calls"] = [c for c in delta["tool_calls"] if c.get("index", 0) == 0]
        if delta.get("tool_calls"):
            self.streamed_calls = True
        return delta or None

    def finish_reason(self, engine_reason: str, found_calls: bool) -> str:
        """vLLM's: ``tool_calls`` when an output that ended normally made calls (on
        ``auto`` or ``required``); a named choice keeps the engine's reason."""
        if engine_reason == "stop" and found_calls and not self._session.named:
            return "tool_calls"
        return engine_reason
