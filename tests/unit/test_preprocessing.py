"""Where a request is tokenized (``preprocess.Preprocessing``): a short body on the event
loop, with the loop's tokenizer; a long one (or one of undeclared size) on the
preprocess thread, with a copy of its own, so the loop serves other streams meanwhile.
Both give the same request."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pdserve.router.http.openai.preprocess import (
    INLINE_MAX_BODY_BYTES,
    Preprocessing,
    Preprocessor,
)
from pdserve.router.http.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
)

MODEL = "SmolLM2-135M-Instruct"


class Recording:
    """A tokenizer that records the thread of each call it serves, and which copy
    (``copies``: 0 the original, 1 its deep copy) served it."""

    def __init__(self, inner: Any, calls: list[tuple[str, int]], copies: int = 0) -> None:
        self._inner, self._calls, self._copy = inner, calls, copies

    def __deepcopy__(self, memo: dict[int, Any]) -> Recording:
        import copy

        return Recording(copy.deepcopy(self._inner, memo), self._calls, self._copy + 1)

    def _record(self) -> None:
        self._calls.append((threading.current_thread().name, self._copy))

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self._inner.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._record()
        return self._inner.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _preprocessing(tokenizer: Any, calls: list[tuple[str, int]]) -> Preprocessing:
    return Preprocessing(lambda t: Preprocessor(
        served_model_name=MODEL, max_model_len=4096, tokenizer=t), Recording(tokenizer, calls))


@pytest.mark.parametrize("endpoint", ["completion", "chat"])
async def test_a_short_body_is_tokenized_on_the_loop_a_long_one_on_the_thread(
        tokenizer: Any, endpoint: str) -> None:
    calls: list[tuple[str, int]] = []
    pre = _preprocessing(tokenizer, calls)
    text = "The quick brown fox jumps over the lazy dog. " * 4
    body: CompletionRequest | ChatCompletionRequest = (
        CompletionRequest(model=MODEL, prompt=text) if endpoint == "completion"
        else ChatCompletionRequest(model=MODEL, messages=[ChatMessage(role="user", content=text)]))
    run = pre.completion if endpoint == "completion" else pre.chat

    loop_thread = threading.current_thread().name
    results, where = [], []
    for size in (INLINE_MAX_BODY_BYTES, INLINE_MAX_BODY_BYTES + 1, None):
        calls.clear()
        results.append(await run(body, size, "r", None))  # type: ignore[arg-type]
        where.append(set(calls))

    assert where[0] == {(loop_thread, 0)}  # the loop's own tokenizer, on the loop
    for threaded in where[1:]:  # the copy, on the preprocess thread
        assert len(threaded) == 1 and next(iter(threaded))[0] != loop_thread
        assert next(iter(threaded))[1] == 1
    assert len({tuple(r.prompt_token_ids) for r in results}) == 1
