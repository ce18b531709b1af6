"""Logprobs as ``vllm serve`` writes them, from the engines' per-position candidates.

The engines return, per position, the token there and the candidates vLLM reports
(``TokenLogprobs``: the token first, then the top-k by rank). The router turns ids into
text the way vLLM's output processor does (``vllm/v1/engine/logprobs.py``):
``tokenizer.decode([id])``; a SentencePiece tokenizer's stripped leading spaces restored;
a piece ending in an incomplete UTF-8 character completed from up to 4 preceding tokens
of the sequence, or ``""``. Doing it here, over the whole output, gives the same text on
both paths: a decode engine does not see prefill's first token as output.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.core.types import TokenLogprobs
from pdserve.router.http.base import TokenDecoder
from pdserve.router.http.openai.response_schemas import (
    CompletionLogprobs,
    LogprobContent,
    TopLogprob,
)

LOGPROB_FLOOR = -9999.0  # vLLM's stand-in for -inf
_INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 4  # preceding tokens enough to complete any UTF-8 character


class PieceTokenizer(TokenDecoder, Protocol):
    """The part of a Hugging Face tokenizer logprob texts need."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...


class LogprobText:
    """Token ids to the strings vLLM reports in logprobs."""

    def __init__(self, tokenizer: PieceTokenizer) -> None:
        self._tokenizer = tokenizer
        self._marker = _leading_space_marker(tokenizer)

    def texts(self, ids: Sequence[int], context: Sequence[int]) -> list[str]:
        """The strings of one position's candidates; ``context``: the tokens before it."""
        texts = [self._piece(i) for i in ids]
        return [self._complete(i, list(context[-CONTEXT_TOKENS:])) if t.endswith(_INCOMPLETE) else t
                for i, t in zip(ids, texts, strict=True)]

    def decode(self, ids: list[int]) -> str:
        """As vLLM decodes logprob tokens: special tokens written out."""
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def _piece(self, token_id: int) -> str:
        text = self.decode([token_id]) or ""
        if self._marker is None:
            return text
        raw = self._tokenizer.convert_ids_to_tokens([token_id])[0]
        markers = len(raw) - len(raw.lstrip(self._marker))
        missing = markers - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def _complete(self, token_id: int, context: list[int]) -> str:
        """vLLM's ``_correct_decoded_token``: the text this token completes, with the
        fewest preceding tokens that make it whole."""
        for num in range(1, len(context) + 1):
            before = context[-num:]
            full = self.decode([*before, token_id])
            if full.endswith(_INCOMPLETE):
                continue
            clean_end = len(before)
            for j in range(len(before) - 1, -1, -1):
                if not self.decode([before[j]]).endswith(_INCOMPLETE):
                    break
                clean_end = j
            prefix = self.decode(before[:clean_end]) if clean_end > 0 else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0
            for a, b in zip(prefix, full, strict=False):
                if a != b:
                    break
                common += 1
            return full[common:]
        return ""


def _leading_space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character of a SentencePiece tokenizer (None for others,
    whose single-token decode keeps its spaces)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        config = json.loads(backend.to_str())
    except Exception:  # noqa: BLE001 - a tokenizer that cannot describe itself: no marker
        return None
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    for step in steps:
        if isinstance(step, dict) and step.get("type") == "Metaspace":
            return str(step.get("replacement", "\u2581"))
    return None


def _floor(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def chat_entries(text: LogprobText, positions: Sequence[TokenLogprobs],
                 context: Sequence[int], top_k: int) -> list[LogprobContent]:
    """Chat's ``logprobs.content`` for ``positions``; ``context``: the output tokens
    before the first. ``top_logprobs`` is vLLM's: its first ``top_k`` candidates (the
    sampled token first)."""
    out: list[LogprobContent] = []
    before = list(context)
    for position in positions:
        ids = [e[0] for e in position.entries]
        strings = text.texts(ids, before)
        sampled = next((i for i, e in enumerate(position.entries)
                        if e[0] == position.token_id), None)
        token = strings[sampled] if sampled is not None else text.texts(
            [position.token_id], before)[0]
        logprob = _floor(position.entries[sampled][1]) if sampled is not None else LOGPROB_FLOOR
        top = [TopLogprob(token=s, logprob=_floor(e[1]), bytes=list(s.encode("utf-8", "replace")))
               for s, e in zip(strings[:top_k], position.entries[:top_k], strict=True)]
        out.append(LogprobContent(token=token, logprob=logprob,
                                  bytes=list(token.encode("utf-8", "replace")),
                                  top_logprobs=top))
        before.append(position.token_id)
    return out


def completion_logprobs(result: CompletionLogprobs, text: LogprobText,
                        positions: Sequence[TokenLogprobs], context: Sequence[int],
                        top_k: int, offset: int, first_in_prompt: bool = False) -> int:
    """Append the legacy endpoint's logprobs for ``positions`` (the text starting at
    ``offset``) to ``result``; the offset after them. A position with no candidates is the
    prompt's first (no logprob). The prompt's context skips its first token, as vLLM's
    does (``first_in_prompt``)."""
    before = list(context)
    skip = 1 if first_in_prompt else 0
    for position in positions:
        if not position.entries:
            token = text.decode([position.token_id])
            result.tokens.append(token)
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
        else:
            usable = before[max(len(before) - CONTEXT_TOKENS, skip):]
            strings = text.texts([e[0] for e in position.entries], usable)
            token = strings[0]
            result.tokens.append(token)
            result.token_logprobs.append(_floor(position.entries[0][1]))
            result.top_logprobs.append({s: _floor(e[1]) for s, e in zip(
                strings[:top_k + 1], position.entries[:top_k + 1], strict=True)})
        result.text_offset.append(offset)
        offset += len(token)
        before.append(position.token_id)
    return offset
