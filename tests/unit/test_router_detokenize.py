"""Incremental detokenization and stop strings, on the default model's real tokenizer."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.decoders import Metaspace
from tokenizers.models import BPE

from pdserve.router.http.openai import detokenize
from pdserve.router.http.openai.detokenize import IncrementalDetokenizer, StopStringMatcher

TEXTS = [
    "Plain ASCII, with punctuation: done.",
    " 你好，世界！🙂 Emoji 👍🏽 and 日本語のテキスト.",
    "naïve café — Ω≈ç√ 𝄞 👨‍👩‍👧‍👦 family",
    "code:\n\tdef f(x):\n\t\treturn x  # ok\n",
]


def stream(detokenizer: IncrementalDetokenizer, ids: list[int], step: int) -> list[str]:
    deltas = [detokenizer.add(ids[i : i + step]) for i in range(0, len(ids), step)]
    return [*deltas, detokenizer.finish()]


@pytest.mark.parametrize("step", [1, 2, 3, 7])
@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_full_decode(tokenizer: Any, text: str, step: int) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, step)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert not any(d.endswith("\ufffd") for d in deltas[:-1])


def test_special_tokens_are_skipped(tokenizer: Any) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi 🙂<|im_end|>", add_special_tokens=False)
    assert "".join(stream(IncrementalDetokenizer(tokenizer), ids, 1)) == "assistant\nHi 🙂"


def test_incomplete_character_at_the_end_is_flushed(tokenizer: Any) -> None:
    ids = tokenizer.encode("ok 🙂🙂", add_special_tokens=False)[:-1]  # cut inside the emoji
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, 1)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)
    assert deltas[-1].endswith("\ufffd")


def test_stop_string_across_tokens_truncates_and_stops_consuming(tokenizer: Any) -> None:
    text = " Paris is the capital of France. It is known for the Eiffel Tower."
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["Tower", " of Fr"])
    deltas = stream(detokenizer, ids, 1)
    assert "".join(deltas) == " Paris is the capital"
    assert detokenizer.stopped  # at " of Fr", which comes before "Tower"
    assert tokenizer.decode(detokenizer.token_ids) == " Paris is the capital of France"
    assert detokenizer.add(ids) == ""  # after a stop nothing more is consumed


def test_stop_string_inside_multibyte_text(tokenizer: Any) -> None:
    text = " 你好，世界！🙂 Emoji"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["！🙂"])
    assert "".join(stream(detokenizer, ids, 1)) == " 你好，世界"
    assert detokenizer.stopped


def test_stop_prefix_is_held_then_released(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world, this is a test.", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=[" test!"])
    deltas = stream(detokenizer, ids, 1)
    assert "".join(deltas) == "Hello world, this is a test."
    assert "test" not in "".join(deltas[:-2])  # " test" was held until it could not match
    assert not detokenizer.stopped


def test_matcher_first_completed_stop_wins() -> None:
    matcher = StopStringMatcher(["cd", "bcd!", "b"])
    assert matcher.feed("aa") == "aa"
    assert matcher.feed("abcd") == "a"
    assert matcher.matched == "b"
    assert matcher.feed("more") == ""


def test_matcher_overlapping_prefixes() -> None:
    matcher = StopStringMatcher(["aab"])
    out = [matcher.feed(c) for c in "xaaab"]
    assert out == ["x", "", "", "a", ""]
    assert matcher.matched == "aab"


@given(
    text=st.text(alphabet="abc", max_size=30),
    stop=st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=4),
    cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=8),
)
def test_matcher_any_split_gives_the_truncated_text(
    text: str, stop: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    matcher = StopStringMatcher(stop)
    out = "".join(matcher.feed(p) for p in pieces)
    # The first stop string to complete wins; on a tie, the one that starts first.
    hits = [(i + len(s), i) for s in stop if (i := text.find(s)) >= 0]
    if hits:
        assert out == text[: min(hits)[1]] and matcher.matched is not None
    else:
        assert out + matcher.flush() == text and matcher.matched is None


class _PythonOnly:
    """The tokenizer's ``decode`` alone: the detokenizer's Python algorithm."""

    def __init__(self, tokenizer: Any) -> None:
        self.decode = tokenizer.decode


def _window_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Detokenizers made from here on decode windows (no byte table)."""
    monkeypatch.setattr(detokenize, "byte_table", lambda tokenizer, skip: None)


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151), max_size=40), step=st.integers(1, 4),
       skip=st.booleans())
def test_the_rust_stream_gives_the_python_algorithms_deltas(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch, ids: list[int], step: int,
        skip: bool) -> None:
    """Any ids (special tokens, split characters, byte tokens): the same deltas, step by
    step, from ``DecodeStream`` as from the two ``decode`` calls per token (a tokenizer
    without a byte table: not byte-level BPE)."""
    with monkeypatch.context() as patch:
        _window_only(patch)
        rust = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        python = IncrementalDetokenizer(_PythonOnly(tokenizer), skip_special_tokens=skip)
    assert rust._stream is not None and python._stream is None
    assert stream(rust, ids, step) == stream(python, ids, step)


def test_the_byte_table_holds_each_ids_text(tokenizer: Any) -> None:
    """Every id of the vocabulary, special or not, decodes from its bytes to what the
    tokenizer gives for it alone."""
    first, second = detokenize.byte_table(tokenizer, False), detokenize.byte_table(tokenizer, True)
    assert first is not None and second is not None
    (with_special, texts), (without, _) = first, second
    assert len(with_special) == len(without) == len(tokenizer)
    for token_id, raw in enumerate(with_special):
        assert raw.decode("utf-8", "replace") == tokenizer.decode([token_id]), token_id
        assert without[token_id].decode("utf-8", "replace") == tokenizer.decode(
            [token_id], skip_special_tokens=True), token_id
        assert texts[token_id] in ("", tokenizer.decode([token_id]))
    assert without[0] == b"" and with_special[0] == b"<|endoftext|>"
    assert sum(map(bool, texts)) > 0.9 * len(texts)


def test_a_tokenizer_that_is_not_byte_level_has_no_table(tokenizer: Any) -> None:
    assert detokenize.byte_table(_PythonOnly(tokenizer), True) is None
    metaspace = Tokenizer(BPE())
    metaspace.decoder = Metaspace()
    assert detokenize._byte_tables(metaspace) is None


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(0, 49151 + 3), max_size=40), step=st.integers(1, 4),
       skip=st.booleans())
def test_the_byte_table_gives_the_windows_deltas(
        tokenizer: Any, monkeypatch: pytest.MonkeyPatch, ids: list[int], step: int,
        skip: bool) -> None:
    """Any ids (special tokens, split characters, invalid bytes, ids past the
    vocabulary): the same deltas, step by step, from the byte table as from the Rust
    window, and together the tokenizer's text."""
    table = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    with monkeypatch.context() as patch:
        _window_only(patch)
        window = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    assert table._stream is None and window._stream is not None
    by_table = stream(table, ids, step)
    assert by_table == stream(window, ids, step)
    assert "".join(by_table) == tokenizer.decode(ids, skip_special_tokens=skip)
