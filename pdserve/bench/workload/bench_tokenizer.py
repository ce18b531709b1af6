"""The load generator's tokenizer: the model folder's ``tokenizer.json`` through
``tokenizers`` and its chat template through jinja2, rendered as transformers renders it,
without importing transformers (~1 s of CPU at every ``pdserve bench run``).

Only what ``PromptEncoder`` asks (``encode``, ``decode``, ``all_special_ids``, ``len``,
``apply_chat_template`` to text), and only for a folder whose transformers tokenizer is
that same Rust tokenizer with nothing added in Python (``pdserve.core.tokenizer
.loads_directly``), one chat template in ``tokenizer_config.json`` and plain named
special tokens; any other folder gets transformers' tokenizer (``load_bench_tokenizer``).
``tests/unit/test_bench_tokenizer.py`` compares the two on the default model.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdserve.core.tokenizer import load_tokenizer, loads_directly

# The named special tokens transformers passes to a chat template, in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                       "cls_token", "mask_token")
# Files that would give transformers' tokenizer another template or more special tokens.
OTHER_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "additional_chat_templates",
                        "special_tokens_map.json", "added_tokens.json")


class BenchTokenizer:
    """A ``tokenizers.Tokenizer`` with the special tokens and chat template of its folder's
    ``tokenizer_config.json``; answers as transformers' ``TokenizersBackend`` does."""

    def __init__(self, backend: Tokenizer, special: dict[str, str], chat_template: str) -> None:
        self.backend = backend
        self.special_tokens_map = special
        ids = (backend.token_to_id(t) for t in dict.fromkeys(special.values()))
        self.all_special_ids = [i for i in ids if i is not None]
        self._template = _compile(chat_template)

    def __len__(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(self.backend.decode(ids, skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, conversation: list[dict[str, str]],
                            add_generation_prompt: bool = False, tokenize: bool = False) -> str:
        """The rendered text (``tokenize=True`` is not offered: encode the text)."""
        if tokenize:
            raise ValueError("BenchTokenizer renders text only (tokenize=False)")
        if not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. "
                             "Provide at least one message.")
        return self._template.render(messages=conversation, tools=None, documents=None,
                                     add_generation_prompt=add_generation_prompt,
                                     **self.special_tokens_map)


def load_bench_tokenizer(path: str | Path) -> Any:
    """A ``BenchTokenizer`` where it answers as transformers' tokenizer would, else that
    tokenizer (``pdserve.core.tokenizer.load_tokenizer``)."""
    folder = Path(path)
    parts = _bench_parts(folder)
    if parts is None:
        return load_tokenizer(folder)
    special, template = parts
    return BenchTokenizer(Tokenizer.from_file(str(folder / "tokenizer.json")), special, template)


def _bench_parts(folder: Path) -> tuple[dict[str, str], str] | None:
    """The named special tokens and the chat template, or None where transformers might
    see more (or other) than ``tokenizer_config.json`` says."""
    if not loads_directly(folder) or any((folder / f).exists() for f in OTHER_TEMPLATE_FILES):
        return None
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = config.get("chat_template")
    if not isinstance(template, str) or config.get("clean_up_tokenization_spaces"):
        return None
    if re.search(r"\{%-?\s*generation\s*-?%\}", template):  # transformers' own tag
        return None
    if config.get("extra_special_tokens") or config.get("additional_special_tokens"):
        return None
    special = {n: config[n] for n in SPECIAL_TOKEN_NAMES if config.get(n) is not None}
    if not all(isinstance(v, str) for v in special.values()):
        return None
    return special, template


def _compile(template: str) -> jinja2.Template:
    """As transformers compiles a chat template (``_cached_compile_jinja_template``): a
    sandbox, trimmed blocks, loop controls, its ``tojson``, ``raise_exception`` and
    ``strftime_now``."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)
