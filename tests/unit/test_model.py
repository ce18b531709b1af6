"""Unit tests for pdserve.core.model: model resolution and the one-time GGUF conversion.

The real GGUF conversion takes about a minute on CPU, so it runs once per module (fixture
`converted`); the other tests swap in a fake or fast `_convert`/`_load_gguf` and exercise the
cache, atomicity and locking logic around it. No test touches the user's real cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from pdserve.core import model as pdmodel

NAME = pdmodel.DEFAULT_MODEL_NAME


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own empty cache."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one real conversion of this module, done with HF_HUB_OFFLINE already set."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PDSERVE_CACHE", str(tmp_path_factory.mktemp("converted-cache")))
        mp.setenv("HF_HUB_OFFLINE", "1")
        return pdmodel.prepare_default_model()


def _use_cache_of(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE", str(folder.parent.parent))


def _fake_convert(source: Path, dest: Path) -> None:
    (dest / "config.json").write_text('{"model_type": "llama"}')


def _leftovers(cache: Path) -> list[Path]:
    return sorted((cache / "models").glob(f".{NAME}.tmp-*"))


def test_cache_dir_default_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdmodel.cache_dir() == tmp_path / "cache"
    monkeypatch.delenv("PDSERVE_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert pdmodel.cache_dir() == tmp_path / "home" / ".cache" / "pdserve"


def test_resolve_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match="not a directory") as err:
        pdmodel.resolve_model(str(missing))
    assert str(missing) in str(err.value)


def test_resolve_dir_without_config(tmp_path: Path) -> None:
    folder = tmp_path / "empty-model"
    folder.mkdir()
    with pytest.raises(ValueError, match="config.json") as err:
        pdmodel.resolve_model(str(folder))
    assert str(folder) in str(err.value)


def test_resolve_local_dir(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert pdmodel.resolve_model(str(folder)) == pdmodel.ResolvedModel(folder, "my-model")


@pytest.mark.parametrize("name", [None, "", NAME])
def test_resolve_default(name: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdmodel, "prepare_default_model", lambda: Path("/converted"))
    assert pdmodel.resolve_model(name) == pdmodel.ResolvedModel(Path("/converted"), NAME)


def test_converted_folder_contents(converted: Path) -> None:
    assert converted.name == NAME
    marker = json.loads((converted / pdmodel.MARKER).read_text())
    assert marker["conversion_version"] == pdmodel.CONVERSION_VERSION
    config = json.loads((converted / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["model_type"] == "llama"
    assert config.get("dtype", config.get("torch_dtype")) == "float32"
    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tok_config["chat_template"]
    assert (converted / "tokenizer.json").is_file()
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"][0] == 2  # <|im_end|>
    with open(converted / "model.safetensors", "rb") as fh:  # plain dense float32 tensors
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    assert {t["dtype"] for t in header.values()} == {"F32"}
    assert "model.embed_tokens.weight" in header
    assert not _leftovers(converted.parent.parent)


def test_chat_template_renders(converted: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert isinstance(text, str)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_second_call_does_not_reconvert(converted: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_cache_of(converted, monkeypatch)
    before = (converted / pdmodel.MARKER).stat().st_mtime_ns

    def boom(source: Path, dest: Path) -> None:
        raise AssertionError("must not convert again")

    monkeypatch.setattr(pdmodel, "_convert", boom)
    assert pdmodel.prepare_default_model() == converted
    assert pdmodel.resolve_model(None) == pdmodel.ResolvedModel(converted, NAME)
    assert (converted / pdmodel.MARKER).stat().st_mtime_ns == before


def test_fast_path_imports_no_torch(converted: Path) -> None:
    code = "import sys, pdserve.core.model as m; print(m.prepare_default_model()); "
    code += "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    env = {**os.environ, "PDSERVE_CACHE": str(converted.parent.parent)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == str(converted)


def test_interrupted_save_leaves_nothing_then_retry_succeeds(
    converted: Path, cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fail = {"on": True}

    def fast_load(source: Path) -> tuple[object, object]:
        # Load the already converted weights instead of re-reading the GGUF (a minute).
        model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(converted)
        real_save = tokenizer.save_pretrained

        def save_or_die(*args: Any, **kwargs: Any) -> Any:
            if fail["on"]:  # weights are on disk by now: die midway through saving
                assert (Path(str(args[0])) / "model.safetensors").is_file()
                raise OSError("disk full (simulated)")
            return real_save(*args, **kwargs)

        tokenizer.save_pretrained = save_or_die  # type: ignore[method-assign]
        return model, tokenizer

    monkeypatch.setattr(pdmodel, "_load_gguf", fast_load)
    final = cache / "models" / NAME
    with pytest.raises(OSError, match="simulated"):
        pdmodel.prepare_default_model()
    assert not final.exists()
    assert not _leftovers(cache)

    # A run killed outright (no cleanup) leaves a temp dir; the next run must sweep it.
    (cache / "models" / f".{NAME}.tmp-killed").mkdir()
    fail["on"] = False
    assert pdmodel.prepare_default_model() == final
    assert (final / pdmodel.MARKER).is_file() and (final / "tokenizer_config.json").is_file()
    assert "quantization_config" not in json.loads((final / "config.json").read_text())
    assert not _leftovers(cache)


def test_outdated_marker_is_rebuilt(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = cache / "models" / NAME
    final.mkdir(parents=True)
    (final / "stale.bin").write_text("old")
    (final / pdmodel.MARKER).write_text('{"conversion_version": -1}')
    monkeypatch.setattr(pdmodel, "_convert", _fake_convert)
    assert pdmodel.prepare_default_model() == final
    assert not (final / "stale.bin").exists() and (final / "config.json").is_file()
    assert not _leftovers(cache)


def test_hf_offline_set_during_conversion_and_restored(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    seen: list[str | None] = []

    def spy(source: Path, dest: Path) -> None:
        seen.append(os.environ.get("HF_HUB_OFFLINE"))
        _fake_convert(source, dest)

    monkeypatch.setattr(pdmodel, "_convert", spy)
    pdmodel.prepare_default_model()
    assert seen == ["1"] and "HF_HUB_OFFLINE" not in os.environ


def test_lock_timeout_is_a_clear_error(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdmodel, "LOCK_TIMEOUT_S", 0.5)
    monkeypatch.setattr(pdmodel, "_convert", _fake_convert)
    (cache / "models").mkdir(parents=True)
    lock_path = cache / "models" / f".{NAME}.lock"
    with open(lock_path, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="waiting for") as err:
            pdmodel.prepare_default_model()
    assert str(lock_path) in str(err.value)
    assert pdmodel.prepare_default_model().is_dir()  # lock released: works again


def test_concurrent_threads_convert_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    started = threading.Event()

    def slow(source: Path, dest: Path) -> None:
        calls.append(1)
        started.set()
        threading.Event().wait(0.5)
        _fake_convert(source, dest)

    monkeypatch.setattr(pdmodel, "_convert", slow)
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(pdmodel.prepare_default_model()))]
    threads[0].start()
    started.wait(10)  # second caller arrives while the first holds the lock
    threads.append(threading.Thread(target=lambda: results.append(pdmodel.prepare_default_model())))
    threads[1].start()
    for t in threads:
        t.join(30)
    assert len(calls) == 1 and len(results) == 2 and results[0] == results[1]


def test_concurrent_processes_convert_once(cache: Path) -> None:
    log = cache.parent / "convert-calls.log"
    script = textwrap.dedent(
        f"""
        import os, time
        from pathlib import Path
        import pdserve.core.model as m

        def slow(source, dest):
            with open({str(log)!r}, "a") as fh:
                fh.write(f"{{os.getpid()}}\\n")
            time.sleep(1.0)
            (dest / "config.json").write_text("{{}}")

        m._convert = slow
        print(m.prepare_default_model())
        """
    )
    env = {**os.environ, "PDSERVE_CACHE": str(cache)}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1] == str(cache / "models" / NAME)
    assert len(log.read_text().splitlines()) == 1
    assert not _leftovers(cache)
