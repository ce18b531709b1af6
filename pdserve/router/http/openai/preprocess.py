"""Validated OpenAI request -> ``GenerationRequest``: model check, chat template, tokenization
(once, here), context-length check and the token-level ``SamplingSpec``."""

from __future__ import annotations

import asyncio
import contextvars
import copy
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol, TypeVar

from pdserve.core.lora import LoraAdapter
from pdserve.core.types import SamplingSpec, StructuredOutput
from pdserve.router.http.errors import (
    ContextLengthExceededError,
    InvalidRequestError,
    ModelNotFoundError,
)
from pdserve.router.http.openai.logprobs import PieceTokenizer
from pdserve.router.http.openai.schemas import (
    LOGIT_BIAS_LIMIT,
    ChatCompletionRequest,
    CompletionRequest,
    has_lone_surrogate,
)
from pdserve.router.http.openai.structured import structured_output
from pdserve.router.http.openai.tool_calls import (
    ToolCalling,
    ToolSession,
    effective_choice,
    no_tool_parser_error,
)

GREEDY_TEMPERATURE = 1e-5  # below it vLLM samples greedily (and refuses n > 1)

# OpenAI's legacy completions endpoint defaults to 16 tokens.
DEFAULT_COMPLETION_MAX_TOKENS = 16

Endpoint = Literal["completions", "chat"]
T = TypeVar("T")


class Tokenizer(PieceTokenizer, Protocol):
    """The part of a Hugging Face tokenizer the router uses (logprob texts' too)."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __len__(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...


class LoraNames(Protocol):
    """The LoRA adapters a router serves (``dispatch.lora_catalog.LoraCatalog``)."""

    def adapter(self, name: str | None) -> LoraAdapter | None: ...


@dataclass(frozen=True)
class GenerationRequest:
    """One request, validated and tokenized, with what is needed to answer it.

    ``request_id``: the workers' id of the request (what an abort names), unique and
    unguessable: the response's id, a dot, 128 random bits (``secrets``), so that no
    client id (``X-Request-Id``), however chosen, names another request on the workers,
    of another router process, replica or tenant. ``response_id``: the OpenAI ``id``
    the client sees, ``cmpl-<edge id>`` / ``chatcmpl-<edge id>`` as vLLM's."""

    request_id: str
    endpoint: Endpoint
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    created: int  # unix seconds, echoed in every response object
    arrival_s: float  # time.perf_counter() when the request arrived
    n: int = 1  # choices: sequences sampled from the one prompt
    response_id: str = ""  # "": the request_id
    echo_text: str | None = None  # completions' echo: the prompt's text, put before each
    tools: ToolSession | None = None  # chat with tools, on a router with a tool parser
    skip_special_tokens: bool = True
    # Tokens an engine stops on (the model's end of sequence, the request's
    # stop_token_ids): ending the output, they count but their text is not output.
    stop_token_set: frozenset[int] = frozenset()


class Preprocessor:
    """Turns validated request bodies into ``GenerationRequest``s; raises ``APIError``s."""

    def __init__(self, *, served_model_name: str, max_model_len: int, tokenizer: Tokenizer,
                 tool_calling: ToolCalling | None = None,
                 eos_token_ids: frozenset[int] | None = None,
                 loras: LoraNames | None = None):
        """``eos_token_ids``: the ids the engines end a sequence on (the model's
        generation config's; default: the tokenizer's end of sequence). ``loras``: the
        LoRA adapters served (a ``model`` naming one runs it; None: none)."""
        self.served_model_name = served_model_name
        self._loras = loras
        self._eos_token_ids = (eos_token_ids if eos_token_ids is not None
                               else _tokenizer_eos(tokenizer))
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)
        self._tool_calling = tool_calling

    def completion(self, body: CompletionRequest, request_id: str | None = None,
                   arrival_s: float | None = None) -> GenerationRequest:
        """``request_id``: the id the router's edge gave the request (default: a fresh
        one); the workers see ``cmpl-<request_id>``. ``arrival_s``: ``perf_counter()``
        at arrival (default: now)."""
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        lora = self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self._encode(body.prompt, "prompt", add_special_tokens=True)
        else:
            prompt_ids = self._check_token_ids(body.prompt)
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        echo_text = None
        if body.echo:  # vLLM echoes a token-id prompt as its text, special tokens and all
            echo_text = (body.prompt if isinstance(body.prompt, str)
                         else self._tokenizer.decode(prompt_ids, skip_special_tokens=False))
        return self._build("completions", body, prompt_ids, max_tokens, arrival_s, request_id,
                           echo_text=echo_text, lora=lora)

    def chat(self, body: ChatCompletionRequest, request_id: str | None = None,
             arrival_s: float | None = None) -> GenerationRequest:
        """As ``completion``; the workers see ``chatcmpl-<request_id>``."""
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        lora = self._check_model(body.model)
        tools = self._tool_session(body)
        try:
            text = self._tokenizer.apply_chat_template(
                body.template_messages(), add_generation_prompt=True, tokenize=False,
                tools=[t.for_template() for t in body.tools] if body.tools else None,
            )
        except Exception as exc:  # templates raise anything (jinja errors, TypeError, ...)
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
        prompt_ids = self._encode(str(text), "messages", add_special_tokens=False)
        max_tokens = body.requested_max_tokens or self.max_model_len - len(prompt_ids)
        return self._build("chat", body, prompt_ids, max_tokens, arrival_s, request_id,
                           tools=tools, lora=lora)

    def _tool_session(self, body: ChatCompletionRequest) -> ToolSession | None:
        """vLLM's parser for a request that may call tools (None: text only)."""
        choice = effective_choice(body.tools, body.tool_choice)
        if not body.tools or choice == "none" and self._tool_calling is None:
            return None
        if self._tool_calling is None:
            raise no_tool_parser_error(choice)
        self._tool_calling.check(choice)
        try:
            return self._tool_calling.session(
                body.model_dump(mode="json", by_alias=True, exclude_unset=True))
        except ValueError as exc:  # vLLM's own validation (pydantic's included)
            raise InvalidRequestError(str(exc), param="tools") from exc

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """The prompt's token ids; text that is not valid Unicode (a lone surrogate,
        which JSON can carry) is a 400 naming ``param``, not a tokenizer's TypeError."""
        if has_lone_surrogate(text):
            raise InvalidRequestError(f"{param}: not valid Unicode (a lone surrogate)",
                                      param=param)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _check_model(self, model: str) -> LoraAdapter | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for neither."""
        if model == self.served_model_name:
            return None
        adapter = self._loras.adapter(model) if self._loras is not None else None
        if adapter is None:
            raise ModelNotFoundError(model)
        return adapter

    def _out_of_vocab(self, token_ids: Sequence[int]) -> list[int]:
        return [t for t in token_ids if not 0 <= t < self._vocab_size]

    def _check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        if bad := self._out_of_vocab(token_ids):
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {self._vocab_size})",
                param="prompt",
            )
        return list(token_ids)

    def _check_vocab(self, param: str, token_ids: Sequence[int]) -> None:
        """vLLM's check of ``logit_bias`` and ``stop_token_ids`` ids, with its words."""
        if bad := self._out_of_vocab(token_ids):
            raise InvalidRequestError(
                f"token_id(s) {bad} in {param} contain out-of-vocab token ids. "
                f"Vocabulary size: {self._vocab_size}", param=param)

    def _build(
        self,
        endpoint: Endpoint,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int,
        arrival_s: float,
        request_id: str | None,
        echo_text: str | None = None,
        tools: ToolSession | None = None,
        lora: LoraAdapter | None = None,
    ) -> GenerationRequest:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if max_tokens < 1 or len(prompt_ids) + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                num_prompt_tokens=len(prompt_ids),
                max_tokens=max(max_tokens, 0),
                max_model_len=self.max_model_len,
            )
        sampling = _sampling_spec(body, max_tokens, _structured(body, tools))
        if lora is not None:  # its exact identity: the request runs that folder or none
            sampling = replace(sampling, lora_name=lora.name, lora_path=lora.path)
        n = body.n or 1
        self._check_sampling(n, sampling)
        prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
        response_id = f"{prefix}-{request_id or secrets.token_hex(16)}"
        return GenerationRequest(
            request_id=f"{response_id}.{secrets.token_hex(16)}",
            response_id=response_id,
            endpoint=endpoint,
            # vLLM answers with the adapter's name
            model=lora.name if lora is not None else self.served_model_name,
            prompt_token_ids=tuple(prompt_ids),
            sampling=sampling,
            stop=body.stop_strings,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            return_token_ids=bool(body.return_token_ids),
            created=int(time.time()),
            arrival_s=arrival_s,
            n=n,
            echo_text=echo_text,
            tools=tools,
            skip_special_tokens=(tools.skip_special_tokens if tools is not None
                                 else body.skip_special_tokens),
            stop_token_set=self._eos_token_ids | frozenset(sampling.stop_token_ids),
        )

    def _check_sampling(self, n: int, sampling: SamplingSpec) -> None:
        self._check_vocab("logit_bias", [t for t, _ in sampling.logit_bias])
        self._check_vocab("stop_token_ids", sampling.stop_token_ids)
        if sampling.min_tokens > sampling.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be less than or equal to max_tokens={sampling.max_tokens}, "
                f"got {sampling.min_tokens}.", param="min_tokens")
        if n > 1 and sampling.temperature < GREEDY_TEMPERATURE:
            raise InvalidRequestError(f"n must be 1 when using greedy sampling, got {n}.",
                                      param="n")


class OffLoop:
    """Runs tokenization and chat templating off the event loop, in one thread of its own.

    A long prompt's tokenization (or a template) takes milliseconds to seconds of CPU; on
    the loop it would stall every stream the router serves. One thread, because a Hugging
    Face fast tokenizer is not safe to call from several threads at once ("Already
    borrowed"); the queue in front of it is bounded by admission control. The caller's
    context (its request id, for log lines) goes along.
    """

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pdserve-preprocess")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        context = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(self._pool, context.run, fn,
                                                                *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# A request body up to this size is tokenized on the event loop: its tokenization (and
# chat template) takes 0.1-0.3 ms, less than the hop to the thread and back costs, and
# the other streams wait no longer than that.
INLINE_MAX_BODY_BYTES = 1024


class Preprocessing:
    """Where each request is tokenized: a short one (its body at most
    ``INLINE_MAX_BODY_BYTES``) on the event loop, with the tokenizer the loop already uses
    (to detokenize); any other on the ``OffLoop`` thread, with a copy of its own (a fast
    tokenizer is not to be called from two threads at once). Both answer the same (same
    tokenizer, same checks)."""

    def __init__(self, make: Callable[[Tokenizer], Preprocessor], tokenizer: Tokenizer
                 ) -> None:
        """``make(tokenizer)``: a ``Preprocessor`` around the given tokenizer."""
        self.inline = make(tokenizer)
        self.threaded = make(copy.deepcopy(tokenizer))
        self._off_loop = OffLoop()

    async def completion(self, body: CompletionRequest, body_bytes: int | None,
                         request_id: str | None, arrival_s: float | None) -> GenerationRequest:
        """``body_bytes``: the request body's size, when the client said (Content-Length)."""
        if body_bytes is not None and body_bytes <= INLINE_MAX_BODY_BYTES:
            return self.inline.completion(body, request_id, arrival_s)
        return await self._off_loop.run(self.threaded.completion, body, request_id, arrival_s)

    async def chat(self, body: ChatCompletionRequest, body_bytes: int | None,
                   request_id: str | None, arrival_s: float | None) -> GenerationRequest:
        if body_bytes is not None and body_bytes <= INLINE_MAX_BODY_BYTES:
            return self.inline.chat(body, request_id, arrival_s)
        return await self._off_loop.run(self.threaded.chat, body, request_id, arrival_s)


def _tokenizer_eos(tokenizer: Tokenizer) -> frozenset[int]:
    eos = tokenizer.eos_token_id
    return frozenset([eos]) if isinstance(eos, int) else frozenset()


def _structured(body: CompletionRequest | ChatCompletionRequest,
                tools: ToolSession | None) -> StructuredOutput | None:
    """The tool parser's constraint replaces any other (as in vLLM); else the request's."""
    if tools is not None and (constraint := tools.structured()) is not None:
        return constraint
    return structured_output(body.response_format, body.structured_outputs)


def _sampling_spec(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int,
    structured: StructuredOutput | None,
) -> SamplingSpec:
    top_k = body.top_k or 0
    if isinstance(body, ChatCompletionRequest):
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        prompt_logprobs = None
    else:
        logprobs = body.logprobs
        prompt_logprobs = body.logprobs if body.echo else None
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(top_k, 0),  # -1 and 0 both mean "off"
        min_p=body.min_p or 0.0,
        seed=None if body.seed == -1 else body.seed,  # vLLM: -1 is "no seed"
        stop_token_ids=tuple(dict.fromkeys(body.stop_token_ids or ())),
        ignore_eos=body.ignore_eos,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        min_tokens=body.min_tokens,
        logit_bias=tuple((int(k), max(min(v, LOGIT_BIAS_LIMIT), -LOGIT_BIAS_LIMIT))
                         for k, v in (body.logit_bias or {}).items()),
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured=structured,
        cache_salt=body.cache_salt,
    )
