"""A model folder's Hugging Face tokenizer, as ``AutoTokenizer.from_pretrained`` loads it,
without importing torch where that gives the same tokenizer.

``AutoTokenizer`` imports torch (its module pulls in transformers' model machinery):
~2.5 s of CPU in every process that loads a tokenizer (the router, ``pdserve bench
run``), and torch's teardown at exit. A folder saved by transformers 5 as a plain fast
tokenizer names ``TokenizersBackend`` in its ``tokenizer_config.json``; for the model
types listed here ``AutoTokenizer`` then loads exactly that class
(``TokenizersBackend.from_pretrained``), which imports no torch. Any other folder (a
tokenizer class of its own, remote code, another model type, transformers 4) goes
through ``AutoTokenizer`` as before. ``tests/unit/test_tokenizer_loader.py`` checks the
two agree on the default model and that transformers still picks this class for these
model types.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The class a transformers 5 fast tokenizer is saved as.
BACKEND_CLASS = "TokenizersBackend"
# Model types for which AutoTokenizer keeps a folder's TokenizersBackend (none is in
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, which it replaces).
DIRECT_MODEL_TYPES = frozenset({"llama"})


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of the model folder ``path``, as ``AutoTokenizer.from_pretrained``
    loads it (``OSError``/``ValueError`` as it raises them)."""
    folder = Path(path)
    if loads_directly(folder):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def loads_directly(folder: Path) -> bool:
    """Whether ``folder``'s tokenizer is a ``TokenizersBackend`` that ``AutoTokenizer``
    would load as it is (then loaded without ``AutoTokenizer``)."""
    tokenizer_config = _json(folder / "tokenizer_config.json")
    model_config = _json(folder / "config.json")
    return (tokenizer_config.get("tokenizer_class") == BACKEND_CLASS
            and "auto_map" not in tokenizer_config and "auto_map" not in model_config
            and model_config.get("model_type") in DIRECT_MODEL_TYPES
            and (folder / "tokenizer.json").is_file() and _has_backend())


def _json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _has_backend() -> bool:
    """transformers 5 (its ``TokenizersBackend`` module; 4 has none), found without
    importing transformers."""
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    return spec is not None and any(
        (Path(p) / "tokenization_utils_tokenizers.py").is_file()
        for p in spec.submodule_search_locations or ())
