"""The load generator's ``BenchTokenizer`` answers as transformers' tokenizer does on the
default model (ids, texts, special ids, chat template, and so the prompts
``PromptEncoder`` builds), without importing transformers; a folder it cannot answer
for gets transformers' tokenizer."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.workload.bench_tokenizer import BenchTokenizer, load_bench_tokenizer
from pdserve.bench.workload.prompts import PromptEncoder, user
from pdserve.core.model import prepare_default_model
from pdserve.core.tokenizer import load_tokenizer

TEXTS = ["", "Hello, world!", "  spaces  ", "naïve café — 東京 🚀", "\n\n\tx = 1\n",
         "<|im_start|>user\nspecial tokens in text<|im_end|>", "The capital of France is"]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
     {"role": "user", "content": "naïve 東京 {{ not jinja }}"}],
]


@pytest.fixture(scope="module")
def pair() -> tuple[Any, Any]:
    path = prepare_default_model()
    return load_bench_tokenizer(path), load_tokenizer(path)


def test_the_default_model_gets_the_bench_tokenizer(pair: tuple[Any, Any]) -> None:
    bench, hf = pair
    assert isinstance(bench, BenchTokenizer) and not isinstance(hf, BenchTokenizer)
    assert len(bench) == len(hf) and bench.all_special_ids == hf.all_special_ids
    assert bench.special_tokens_map == hf.special_tokens_map


def test_same_ids_and_texts(pair: tuple[Any, Any]) -> None:
    bench, hf = pair
    for text in TEXTS:
        for special in (True, False):
            assert bench.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special)
        ids = hf.encode(text, add_special_tokens=True)
        for skip in (True, False):
            assert bench.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip)
    ids = random.Random(0).choices(range(len(hf)), k=500)
    assert bench.decode(ids) == hf.decode(ids)


def test_same_chat_template(pair: tuple[Any, Any]) -> None:
    bench, hf = pair
    for chat in CHATS:
        for generation in (True, False):
            assert bench.apply_chat_template(
                chat, add_generation_prompt=generation, tokenize=False) == hf.apply_chat_template(
                chat, add_generation_prompt=generation, tokenize=False)
    with pytest.raises(ValueError):
        bench.apply_chat_template([], tokenize=False)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_prompt_encoder_builds_the_same_prompts(pair: tuple[Any, Any], endpoint: str) -> None:
    bench, hf = (PromptEncoder(t, endpoint) for t in pair)
    assert bench.vocab == hf.vocab
    for target in (40, 64, 300):
        got = bench.fit_user(target, random.Random(target))
        assert got == hf.fit_user(target, random.Random(target))
        assert hf.count(got.messages) == got.prompt_tokens
    for chat in CHATS:
        assert bench.count(chat) == hf.count(chat) and bench.body(chat) == hf.body(chat)
    assert bench.count(user("")) == hf.count(user(""))


def test_loading_imports_no_transformers() -> None:
    code = ("import sys; from pdserve.bench.workload.bench_tokenizer import load_bench_tokenizer;"
            f" load_bench_tokenizer({str(prepare_default_model())!r});"
            " print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("change", ["template_file", "generation_tag", "extra_special",
                                    "cleanup", "template_dict", "special_dict"])
def test_other_folders_get_transformers_tokenizer(tmp_path: Path, change: str) -> None:
    source, folder = Path(prepare_default_model()), tmp_path / "model"
    folder.mkdir()
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        shutil.copy(source / name, folder / name)
    assert isinstance(load_bench_tokenizer(folder), BenchTokenizer)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if change == "template_file":
        (folder / "chat_template.jinja").write_text(config["chat_template"])
    elif change == "generation_tag":
        config["chat_template"] += "{% generation %}{% endgeneration %}"
    elif change == "extra_special":
        config["extra_special_tokens"] = ["<reponame>"]
    elif change == "cleanup":
        config["clean_up_tokenization_spaces"] = True
    elif change == "template_dict":
        config["chat_template"] = [{"name": "default", "template": config["chat_template"]}]
    else:
        config["eos_token"] = {"content": config["eos_token"], "special": True}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if change == "special_dict":  # transformers' own refusal: it was asked
        with pytest.raises(TypeError, match="eos_token"):
            load_bench_tokenizer(folder)
        return
    assert not isinstance(load_bench_tokenizer(folder), BenchTokenizer)
