"""perturb_checkpoint on a tiny synthetic safetensors folder: what it copies, what it
perturbs and by how much, that a seed fixes the bytes, and what it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.bench.models.checkpoints import perturb_checkpoint


def _model(folder: Path) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / ".pdserve-complete").write_text("{}")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("kept")
    gen = torch.Generator().manual_seed(1)
    save_file({"w": torch.randn(64, 64, generator=gen),
               "half": torch.randn(32, generator=gen).to(torch.bfloat16),
               "one": torch.tensor([2.0]),
               "ids": torch.arange(10)}, str(folder / "model-00001-of-00002.safetensors"),
              metadata={"format": "pt"})
    save_file({"b": torch.randn(128, generator=gen)},
              str(folder / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors.index.json").write_text("{}")
    return folder


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(path)))
    return out


def test_copies_the_rest_and_perturbs_floats_relative_to_their_spread(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    dst = perturb_checkpoint(src, tmp_path / "dst", scale=0.1)
    assert sorted(p.name for p in dst.iterdir()) == [
        "config.json", "extra", "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]
    assert (dst / "extra" / "notes.txt").read_text() == "kept"
    before, after = _tensors(src), _tensors(dst)
    assert after.keys() == before.keys()
    assert torch.equal(after["ids"], before["ids"])
    for name in ("w", "half", "one", "b"):
        assert after[name].dtype == before[name].dtype
        assert after[name].shape == before[name].shape
        assert not torch.equal(after[name], before[name]), name
    moved = (after["w"] - before["w"]).std() / before["w"].std()
    assert 0.08 < moved < 0.12
    with safe_open(str(dst / "model-00001-of-00002.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_a_seed_fixes_the_weights(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    first = _tensors(perturb_checkpoint(src, tmp_path / "a", seed=3))
    again = _tensors(perturb_checkpoint(src, tmp_path / "b", seed=3))
    other = _tensors(perturb_checkpoint(src, tmp_path / "c", seed=4))
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["w"], other["w"])


def test_an_empty_destination_folder_is_filled(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    assert (perturb_checkpoint(src, tmp_path / "dst") / "config.json").is_file()


def test_refuses_a_source_without_safetensors(tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        perturb_checkpoint(tmp_path / "src", tmp_path / "dst")
    with pytest.raises(ValueError, match="not a directory"):
        perturb_checkpoint(tmp_path / "missing", tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_refuses_a_non_empty_destination_and_leaves_it_alone(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    (tmp_path / "dst").mkdir()
    (tmp_path / "dst" / "mine.txt").write_text("keep")
    with pytest.raises(ValueError, match="already exists"):
        perturb_checkpoint(src, tmp_path / "dst")
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["mine.txt"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_refuses_a_negative_scale(tmp_path: Path) -> None:
    src = _model(tmp_path / "src")
    with pytest.raises(ValueError, match="scale"):
        perturb_checkpoint(src, tmp_path / "dst", scale=-1.0)


def test_computes_on_one_thread_and_gives_the_caller_its_threads_back(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pdserve.bench.models.checkpoints as checkpoints

    src = _model(tmp_path / "src")
    seen: list[int] = []
    real = checkpoints.perturb_tensor

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    threads = torch.get_num_threads()
    monkeypatch.setattr(checkpoints, "perturb_tensor", spy)
    try:
        torch.set_num_threads(2)
        perturb_checkpoint(src, tmp_path / "a")
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2

        def fail(*args: object, **kwargs: object) -> torch.Tensor:
            raise RuntimeError("disk full")

        monkeypatch.setattr(checkpoints, "perturb_tensor", fail)
        with pytest.raises(RuntimeError, match="disk full"):
            perturb_checkpoint(src, tmp_path / "b")
        assert torch.get_num_threads() == 2 and not (tmp_path / "b").exists()
    finally:
        torch.set_num_threads(threads)
