"""Prompts as the endpoint sees them: token counts through the model's tokenizer and its
chat template, the request body's prompt part, and text built to an exact token count."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Messages = list[dict[str, str]]
MAX_FIT_TRIES = 10


@dataclass(frozen=True)
class BenchRequest:
    """One request of a workload: the conversation, its prompt tokens as the endpoint
    will count them, and the output tokens to ask for. ``prompt_ids``: a prompt of token
    ids sent as they are (completions only; ``messages`` is then empty). ``arrival_s``:
    when to send it, seconds after the run's start (a trace's time), instead of the
    schedule's arrival process."""

    messages: Messages
    prompt_tokens: int
    output_tokens: int
    prompt_ids: tuple[int, ...] | None = None
    arrival_s: float | None = None


def user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


class PromptEncoder:
    """Counts and shapes prompts the way pdserve's router (and vLLM's server) does:
    completions encode the text with special tokens; chat renders the chat template with
    the generation prompt and encodes that without. On ``completions`` a conversation of
    more than one message is sent as its rendered template."""

    def __init__(self, tokenizer: Any, endpoint: str) -> None:
        if endpoint not in ("chat", "completions"):
            raise ValueError(f"endpoint must be 'chat' or 'completions', not {endpoint!r}")
        self.tokenizer = tokenizer
        self.endpoint = endpoint
        special = set(tokenizer.all_special_ids)
        self._ids = [i for i in range(len(tokenizer)) if i not in special]

    @property
    def vocab(self) -> list[int]:
        """The token ids prompts are drawn from (every id but the special ones)."""
        return self._ids

    def tokens(self, text: str) -> int:
        """Plain token count (no template, no special tokens)."""
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def _text(self, messages: Messages) -> str:
        if self.endpoint == "completions" and len(messages) == 1:
            return messages[0]["content"]
        return str(self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False))

    def count(self, messages: Messages) -> int:
        """Prompt tokens of ``messages`` as the endpoint counts them."""
        if self.endpoint == "completions":
            return len(self.tokenizer.encode(self._text(messages), add_special_tokens=True))
        return len(self.tokenizer.encode(self._text(messages), add_special_tokens=False))

    def body(self, messages: Messages, prompt_ids: tuple[int, ...] | None = None
             ) -> dict[str, Any]:
        """The request body's prompt part; ``prompt_ids`` go as a token-id prompt (which
        only completions accept)."""
        if prompt_ids is not None:
            if self.endpoint != "completions":
                raise ValueError("a token-id prompt needs --endpoint completions")
            return {"prompt": list(prompt_ids)}
        if self.endpoint == "chat":
            return {"messages": messages}
        return {"prompt": self._text(messages)}

    def fit(self, target: int, rng: random.Random,
            count: Callable[[str], int] | None = None) -> tuple[str, int]:
        """Text of random tokens whose ``count`` (default: plain tokens) is ``target``:
        decoded, re-encoded and trimmed or extended until it is (vLLM's
        ``gen_prompt_decode_to_target_len``; a tokenizer may merge tokens across the
        seams). Returns the text and its count, which is ``target`` unless
        ``MAX_FIT_TRIES`` did not get there."""
        count = count or self.tokens
        overhead = count("")
        if target <= overhead:
            raise ValueError(f"an input length of {target} tokens leaves nothing for the "
                             f"prompt (the template alone is {overhead} tokens)")
        ids = rng.choices(self._ids, k=target - overhead)
        text, num = "", 0
        for _ in range(MAX_FIT_TRIES):
            text = self.tokenizer.decode(ids)
            num = count(text)
            if num == target:
                break
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            if num > target:
                ids = ids[:max(1, len(ids) - (num - target))]
            else:
                ids += rng.choices(self._ids, k=target - num)
        return text, num

    def fit_user(self, target: int, rng: random.Random) -> BenchRequest:
        """A one-message request whose prompt, as the endpoint counts it, is ``target``."""
        text, num = self.fit(target, rng, lambda t: self.count(user(t)))
        return BenchRequest(user(text), num, 0)
