"""Validated OpenAI request -> ``GenerationRequest``: model check, chat template, tokenization
(once, here), context-length check and the token-level ``SamplingSpec``."""

from __future__ import annotations

import asyncio
import contextvars
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from pdserve.types import SamplingSpec

from .detokenize import TokenDecoder
from .errors import ContextLengthExceededError, InvalidRequestError, ModelNotFoundError
from .schemas import ChatCompletionRequest, CompletionRequest

# OpenAI's legacy completions endpoint defaults to 16 tokens.
DEFAULT_COMPLETION_MAX_TOKENS = 16

Endpoint = Literal["completions", "chat"]
T = TypeVar("T")


class Tokenizer(TokenDecoder, Protocol):
    """The part of a Hugging Face tokenizer the router uses."""

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def __len__(self) -> int: ...


@dataclass(frozen=True)
class GenerationRequest:
    """One request, validated and tokenized, with what is needed to answer it."""

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


class Preprocessor:
    """Turns validated request bodies into ``GenerationRequest``s; raises ``APIError``s."""

    def __init__(self, *, served_model_name: str, max_model_len: int, tokenizer: Tokenizer):
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._vocab_size = len(tokenizer)

    def completion(self, body: CompletionRequest, request_id: str | None = None,
                   arrival_s: float | None = None) -> GenerationRequest:
        """``request_id``: the id the router's edge gave the request (default: a fresh
        one); the workers see ``cmpl-<request_id>``. ``arrival_s``: ``perf_counter()``
        at arrival (default: now)."""
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self._check_model(body.model)
        if isinstance(body.prompt, str):
            prompt_ids = self._tokenizer.encode(body.prompt, add_special_tokens=True)
        else:
            prompt_ids = self._check_token_ids(body.prompt)
        max_tokens = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        return self._build("completions", body, prompt_ids, max_tokens, arrival_s, request_id)

    def chat(self, body: ChatCompletionRequest, request_id: str | None = None,
             arrival_s: float | None = None) -> GenerationRequest:
        """As ``completion``; the workers see ``chatcmpl-<request_id>``."""
        arrival_s = time.perf_counter() if arrival_s is None else arrival_s
        self._check_model(body.model)
        try:
            text = self._tokenizer.apply_chat_template(
                body.template_messages(), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # templates raise anything (jinja errors, TypeError, ...)
            raise InvalidRequestError(f"chat template failed: {exc}", param="messages") from exc
        prompt_ids = self._tokenizer.encode(str(text), add_special_tokens=False)
        max_tokens = body.requested_max_tokens or self.max_model_len - len(prompt_ids)
        return self._build("chat", body, prompt_ids, max_tokens, arrival_s, request_id)

    def _check_model(self, model: str) -> None:
        if model != self.served_model_name:
            raise ModelNotFoundError(model)

    def _check_token_ids(self, token_ids: Sequence[int]) -> list[int]:
        bad = [t for t in token_ids if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidRequestError(
                f"prompt token id {bad[0]} is out of the vocabulary [0, {self._vocab_size})",
                param="prompt",
            )
        return list(token_ids)

    def _build(
        self,
        endpoint: Endpoint,
        body: CompletionRequest | ChatCompletionRequest,
        prompt_ids: list[int],
        max_tokens: int,
        arrival_s: float,
        request_id: str | None,
    ) -> GenerationRequest:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        if max_tokens < 1 or len(prompt_ids) + max_tokens > self.max_model_len:
            raise ContextLengthExceededError(
                num_prompt_tokens=len(prompt_ids),
                max_tokens=max(max_tokens, 0),
                max_model_len=self.max_model_len,
            )
        prefix = "cmpl" if endpoint == "completions" else "chatcmpl"
        return GenerationRequest(
            request_id=f"{prefix}-{request_id or uuid.uuid4().hex}",
            endpoint=endpoint,
            model=self.served_model_name,
            prompt_token_ids=tuple(prompt_ids),
            sampling=_sampling_spec(body, max_tokens),
            stop=body.stop_strings,
            stream=bool(body.stream),
            include_usage=body.include_usage,
            return_token_ids=bool(body.return_token_ids),
            created=int(time.time()),
            arrival_s=arrival_s,
        )


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


def _sampling_spec(
    body: CompletionRequest | ChatCompletionRequest, max_tokens: int
) -> SamplingSpec:
    top_k = body.top_k or 0
    return SamplingSpec(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=max(top_k, 0),  # -1 and 0 both mean "off"
        seed=body.seed,
        ignore_eos=body.ignore_eos,
    )
