"""Token ids to text, incrementally, with OpenAI stop-string semantics.

``IncrementalDetokenizer`` turns the ids of one request's output into text deltas as
they arrive. Deltas never end inside a multi-byte character and never contain text that
could still turn out to be the start of a stop string. When a stop string appears, the
text before it is the last delta and no further ids are consumed. Without a stop match,
the deltas concatenated (including ``finish()``) equal
``tokenizer.decode(ids, skip_special_tokens=...)``, where ``ids`` leaves out a last
stop token (``add(..., last_stops=True)``), as vLLM does.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from pdserve.router.http.base import TokenDecoder

_INCOMPLETE = "\ufffd"  # what a decoder returns for a truncated UTF-8 sequence


class StopStringMatcher:
    """Holds back text that may be the start of a stop string; finds the first to complete.

    Text passes through ``feed``; what it returns is safe to send. After a match,
    ``matched`` is the stop string and everything from it on is dropped.
    """

    def __init__(self, stop: Sequence[str]) -> None:
        self.stops = tuple(stop)
        self._held = ""
        self.matched: str | None = None

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        # The held part never contains a whole stop string, so any match is new. The stop
        # string that completes first wins (generation would have stopped there); on a tie,
        # the one starting first, so that no part of any matched stop string is sent.
        hits = [(i + len(s), i, s) for s in self.stops if (i := buffer.find(s)) >= 0]
        if hits:
            _, index, self.matched = min(hits)
            self._held = ""
            return buffer[:index]
        keep = self._partial_match_len(buffer)
        self._held = buffer[len(buffer) - keep :]
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Release held-back text at the end of the stream (no stop string completed)."""
        held, self._held = self._held, ""
        return held

    def _partial_match_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop."""
        longest = 0
        for stop in self.stops:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def _byte_level_chars() -> dict[str, int]:
    """The byte-level alphabet (GPT-2's ``bytes_to_unicode``): the character standing for
    each byte in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                 *range(ord("\u00ae"), ord("\u00ff") + 1)]
    chars = {chr(b): b for b in printable}
    others = (b for b in range(256) if b not in chars.values())
    chars.update({chr(256 + n): b for n, b in enumerate(others)})
    return chars


# The bytes of each id, and the text of each id whose bytes are whole characters by
# themselves ("" for any other).
ByteTable = tuple[tuple[bytes, ...], tuple[str, ...]]


@functools.lru_cache(maxsize=8)
def _byte_tables(backend: Tokenizer) -> tuple[ByteTable, ByteTable] | None:
    """``byte_table`` with and without special tokens, where ``backend``'s decoder is
    ``ByteLevel`` alone; else None. That decoder maps each token by itself (its characters
    through the byte-level alphabet, or, for one with a character outside it, its own
    UTF-8) and decodes the bytes of all tokens as one lossy UTF-8 string: the bytes of each
    id, built once, decode any ids exactly as ``backend.decode`` does."""
    if json.loads(backend.to_str()).get("decoder", {}).get("type") != "ByteLevel":
        return None
    alphabet = _byte_level_chars()
    table: list[bytes] = []
    for token_id in range(backend.get_vocab_size(with_added_tokens=True)):
        token = backend.id_to_token(token_id) or ""
        if all(c in alphabet for c in token):
            table.append(bytes(alphabet[c] for c in token))
        else:
            table.append(token.encode())
    texts = [_whole_text(raw) for raw in table]
    skipped, skipped_texts = list(table), list(texts)
    for token_id, added in backend.get_added_tokens_decoder().items():
        if added.special and token_id < len(skipped):
            skipped[token_id], skipped_texts[token_id] = b"", ""
    return (tuple(skipped), tuple(skipped_texts)), (tuple(table), tuple(texts))


def _whole_text(raw: bytes) -> str:
    """An id's text where its bytes are whole characters by themselves (valid UTF-8, not
    ending in U+FFFD, which a window takes for an incomplete character); else ""."""
    try:
        text = raw.decode()
    except UnicodeDecodeError:
        return ""
    return "" if text.endswith(_INCOMPLETE) else text


def byte_table(tokenizer: Any, skip_special_tokens: bool) -> ByteTable | None:
    """The bytes of each id of a fast tokenizer with a byte-level BPE decoder (GPT-2,
    Llama 3, Qwen, SmolLM: ``_byte_tables``), and each id's text where it is whole
    characters; None for any other tokenizer."""
    backend = rust_tokenizer(tokenizer)
    tables = None if backend is None else _byte_tables(backend)
    return None if tables is None else tables[0 if skip_special_tokens else 1]


def rust_tokenizer(tokenizer: Any) -> Tokenizer | None:
    """The ``tokenizers.Tokenizer`` behind a Hugging Face fast tokenizer whose ``decode``
    is exactly that tokenizer's (no clean-up of spaces afterwards); else None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend


class IncrementalDetokenizer:
    """Decodes one request's output ids into text deltas (the TGI/vLLM offsets algorithm).

    Each step decodes a short window: ids from ``prefix_offset`` (context for tokenizers
    whose decoding depends on the previous token) to the end, and emits what goes past
    the text of ``[prefix_offset, read_offset)``, unless the window ends in an incomplete
    character, in which case it waits for more ids.

    With a fast tokenizer (``rust_tokenizer``) the same algorithm runs in Rust
    (``tokenizers``' ``DecodeStream``): one call per token instead of two Python
    ``decode`` calls. If it ever refuses a step, the Python algorithm takes over from
    the same offsets.

    With a byte-level BPE tokenizer (``byte_table``: most of today's models) the
    tokenizer is not called per token at all: the window's text is its ids' bytes from
    the table, decoded as the byte-level decoder does (lossy UTF-8), and an id of whole
    characters after nothing held back is its own text, looked up. The deltas are the
    same, step by step.
    """

    def __init__(
        self,
        tokenizer: TokenDecoder,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._matcher = StopStringMatcher(stop)
        self._prefix_offset = 0
        self._read_offset = 0
        self._decoded: list[str] = []  # what the decoder emitted, before stop handling
        self.token_ids: list[int] = []  # ids consumed, up to the one completing a stop
        self._num_silent = 0  # 1 once the stop token that ended the output is in token_ids
        self._rust = rust_tokenizer(tokenizer)
        table = byte_table(tokenizer, skip_special_tokens)
        self._table, self._texts = table or ((), ())
        # With the table: the bytes of ids[prefix_offset:read_offset] and their text, and
        # of the ids since (held back: an incomplete character, or no text yet).
        self._prefix_bytes = self._pending = b""
        self._prefix_text = ""
        self._stream = (None if self._rust is None or table is not None
                        else DecodeStream(skip_special_tokens=skip_special_tokens))
        self._decode_next = self._window_step if table is None else self._byte_step

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; further ids are ignored."""
        return self._matcher.matched is not None

    def add(self, token_ids: Sequence[int], *, last_stops: bool = False) -> str:
        """Consume ids (stopping early at a stop string) and return the safe text delta.
        ``last_stops``: the last id is the stop token that ended the output (end of
        sequence, or one of ``stop_token_ids``): it is counted, but its text is not part
        of the output, as in vLLM (whatever ``skip_special_tokens`` says). Every streamed
        token passes here: one decoder step and one look at the stop strings per id."""
        ids, matcher, step = self.token_ids, self._matcher, self._decode_next
        if len(token_ids) == 1 and not last_stops and not matcher.stops:
            ids.append(token_ids[0])  # the usual chunk: one id, no stop string to look for
            return step()
        text = ""
        for token_id in token_ids[:-1] if last_stops else token_ids:
            if matcher.matched is not None:
                return text
            ids.append(token_id)
            text += matcher.feed(step())
        if last_stops and token_ids and matcher.matched is None:
            ids.append(token_ids[-1])
            self._num_silent = 1
        return text

    def finish(self) -> str:
        """End of output: return what was held back (an incomplete character at the very
        end, a would-be stop prefix). May still complete a stop string; check ``stopped``."""
        if self.stopped:
            return ""
        full = self._decode(self.token_ids[:len(self.token_ids) - self._num_silent])
        done = "".join(self._decoded)
        tail = full[len(done) :] if full.startswith(done) else ""
        text = self._matcher.feed(tail)
        return text if self.stopped else text + self._matcher.flush()

    def _byte_step(self) -> str:
        """``_window_step``'s algorithm on the ids' bytes (``byte_table``): the window's
        text is its bytes decoded, as ``decode`` would give it, with no call into the
        tokenizer. The usual id, whole characters after nothing held back, is its own
        delta: the window would end in its text (UTF-8 resynchronises at its first byte)."""
        token_id = self.token_ids[-1]
        if not self._pending:
            try:
                text = self._texts[token_id]
            except IndexError:
                text = ""
            if text:
                self._prefix_bytes, self._prefix_text = self._table[token_id], text
                self._decoded.append(text)
                return text
        try:
            pending = self._pending + self._table[token_id]
        except IndexError:  # an id past the vocabulary: no text, as ``decode`` gives
            pending = self._pending
        window = (self._prefix_bytes + pending).decode("utf-8", "replace")
        prefix = self._prefix_text
        if len(window) <= len(prefix) or window.endswith(_INCOMPLETE):
            self._pending = pending
            return ""
        delta = window[len(prefix):]
        self._prefix_bytes, self._pending = pending, b""
        self._prefix_text = pending.decode("utf-8", "replace")
        self._decoded.append(delta)
        return delta

    def _window_step(self) -> str:
        if self._stream is not None and self._rust is not None:
            try:
                delta = self._stream.step(self._rust, self.token_ids[-1])
            except Exception:  # noqa: BLE001 - Rust's InvalidPrefix: decode in Python
                self._stream = None
            else:
                if delta is None:
                    return ""
                self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
                self._decoded.append(delta)
                return delta
        prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        window = self._decode(self.token_ids[self._prefix_offset :])
        if len(window) <= len(prefix) or window.endswith(_INCOMPLETE):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.token_ids)
        delta = window[len(prefix) :]
        self._decoded.append(delta)
        return delta

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
