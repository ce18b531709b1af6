"""``pdserve.core.tokenizer.load_tokenizer`` gives the tokenizer ``AutoTokenizer`` gives
(the same class, the same ids, texts and chat template) without importing torch, and
falls back to ``AutoTokenizer`` for any folder it cannot prove that for."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.core.model import prepare_default_model
from pdserve.core.tokenizer import DIRECT_MODEL_TYPES, load_tokenizer, loads_directly

PROMPTS = ["", "Hello, world!", "  leading and trailing spaces  ", "naïve café — 東京 🚀",
           "<|im_start|>user\nspecial tokens in text<|im_end|>", "\n\n\tcode:\n  x = 1\n",
           "The capital of France is"]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "naïve 東京"}],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    path = prepare_default_model()
    return load_tokenizer(path), AutoTokenizer.from_pretrained(path)


def test_the_default_model_loads_directly() -> None:
    assert loads_directly(Path(prepare_default_model()))


def test_it_is_the_tokenizer_auto_tokenizer_loads(pair: tuple[Any, Any]) -> None:
    fast, auto = pair
    assert type(fast) is type(auto)
    assert len(fast) == len(auto) and fast.all_special_ids == auto.all_special_ids
    assert (fast.eos_token_id, fast.bos_token_id, fast.pad_token_id) == (
        auto.eos_token_id, auto.bos_token_id, auto.pad_token_id)
    assert fast.clean_up_tokenization_spaces == auto.clean_up_tokenization_spaces
    assert fast.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert fast.chat_template == auto.chat_template


def test_same_ids_texts_and_pieces(pair: tuple[Any, Any]) -> None:
    fast, auto = pair
    for text in PROMPTS:
        for special in (True, False):
            ids = auto.encode(text, add_special_tokens=special)
            assert fast.encode(text, add_special_tokens=special) == ids
        ids = auto.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == auto.decode(
                ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    ids = list(range(0, len(auto), 997))
    assert fast.decode(ids) == auto.decode(ids)
    assert copy.deepcopy(fast).encode(PROMPTS[3]) == auto.encode(PROMPTS[3])


def test_same_chat_template(pair: tuple[Any, Any]) -> None:
    fast, auto = pair
    for chat in CHATS:
        for generation in (True, False):
            for tools in (None, TOOLS):
                kwargs: dict[str, Any] = {"add_generation_prompt": generation, "tools": tools}
                text = auto.apply_chat_template(chat, tokenize=False, **kwargs)
                assert fast.apply_chat_template(chat, tokenize=False, **kwargs) == text
                assert fast.encode(text, add_special_tokens=False) == auto.encode(
                    text, add_special_tokens=False)


def test_transformers_keeps_the_class_for_these_model_types() -> None:
    from transformers.models.auto import tokenization_auto

    assert not DIRECT_MODEL_TYPES & tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS


def test_loading_imports_no_torch() -> None:
    code = ("import sys; from pdserve.core.tokenizer import load_tokenizer; "
            f"load_tokenizer({str(prepare_default_model())!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("change", ["class", "auto_map", "model_type", "no_tokenizer_json"])
def test_other_folders_go_through_auto_tokenizer(tmp_path: Path, change: str) -> None:
    folder = tmp_path / "model"
    source = Path(prepare_default_model())
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    assert loads_directly(folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    config = json.loads((folder / "config.json").read_text())
    if change == "class":
        tokenizer_config["tokenizer_class"] = "GPT2Tokenizer"
    elif change == "auto_map":
        tokenizer_config["auto_map"] = {"AutoTokenizer": ["x.Tok", None]}
    elif change == "model_type":
        config["model_type"] = "qwen2"
    else:
        (folder / "tokenizer.json").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps(config))
    assert not loads_directly(folder)
