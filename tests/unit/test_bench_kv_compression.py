"""``pdserve bench kv-compression`` without an engine: the capture is replaced by
synthetic blocks of the CPU layout, the rows and their numbers checked; the engine
comparison's arithmetic on hand-made outputs."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pdserve.bench.micro import kv_compression
from pdserve.bench.micro.configs import KvCompressionConfig
from pdserve.bench.micro.kv_capture import PREFIX_HIT, _compare

SHAPE = (3, 2, 16, 64)  # blocks, heads, tokens, 2 * head_dim


def _fake_capture(dtype: str, config: KvCompressionConfig, path: Path) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    layers = [torch.randn(SHAPE, generator=gen).to(getattr(torch, dtype)) for _ in range(2)]
    quality = {m: {"token_agreement": 1.0, "exact_outputs": 1.0, "mean_abs_dlogprob": 0.0,
                   "cached_tokens_per_prompt": 16.0} for m in (PREFIX_HIT, *config.modes)}
    return {"dtype": dtype, "block_size": 16, "layers": layers,
            "shapes": [(8, *SHAPE[1:])] * 2, "quality": quality}


def test_it_writes_a_row_per_data_dtype_and_mode(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_compression, "_capture", _fake_capture)
    out = tmp_path / "kvz.jsonl"
    config = KvCompressionConfig(dtypes=("float32", "bfloat16"), reps=1, json=str(out))
    assert kv_compression.run(config) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["data"], r["dtype"], r["mode"]) for r in rows] == [
        (data, dtype, mode) for dtype in ("float32", "bfloat16")
        for data in ("engine", "real", "random")
        for mode in ((PREFIX_HIT,) if data == "engine" else ()) + config.modes]
    coded = {(r["data"], r["dtype"], r["mode"]): r for r in rows if r["data"] != "engine"}
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        assert coded["real", dtype, "none"]["ratio"] < 1.0  # the header
        assert coded["real", dtype, "none"]["max_abs_err"] == 0.0
        assert coded["real", dtype, "lossless"]["max_abs_err"] == 0.0
        ratio = size / (1 + 4 / (SHAPE[-1] // 2))  # a float32 scale per head_dim codes
        assert ratio * 0.99 < coded["real", dtype, "int8"]["ratio"] < ratio
        assert 0 < coded["real", dtype, "int8"]["max_err_per_head_absmax"] <= 1 / 254 + 2**-8
        assert 0 < coded["real", dtype, "fp8"]["max_err_per_head_absmax"] <= 1 / 16 + 2**-8
        assert coded["real", dtype, "fp8"]["encode_cpu_ms_per_mib"] > 0


def test_a_failed_capture_is_one_error_line(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    def fail(*args: object) -> dict[str, Any]:
        raise RuntimeError("no engine")
    monkeypatch.setattr(kv_compression, "_capture", fail)
    assert kv_compression.run(KvCompressionConfig(reps=1)) == 1
    assert "pdserve bench kv-compression: error: no engine" in capsys.readouterr().err


def test_bad_values_are_refused() -> None:
    with pytest.raises(ValueError, match="--dtypes"):
        KvCompressionConfig(dtypes=("int4",))
    with pytest.raises(ValueError, match="--modes"):
        KvCompressionConfig(modes=("zip",))


def _output(tokens: list[int], logprobs: list[float], top: list[int] | None = None,
            cached: int = 0) -> Any:
    top = top or tokens
    steps = [{t: SimpleNamespace(logprob=lp), o: SimpleNamespace(logprob=lp + 1)}
             if o != t else {t: SimpleNamespace(logprob=lp)}
             for t, o, lp in zip(tokens, top, logprobs, strict=True)]
    return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=steps)],
                           num_cached_tokens=cached)


def test_the_engine_comparison_counts_agreement_and_logprob_drift() -> None:
    base = [_output([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]),
            _output([5, 6], [-1.0, -1.0])]
    same = [_output([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], cached=128),
            _output([5, 6], [-1.0, -1.0], cached=128)]
    got = _compare(base, same)
    assert got == {"token_agreement": 1.0, "exact_outputs": 1.0, "mean_abs_dlogprob": 0.0,
                   "cached_tokens_per_prompt": 128.0}
    # the second prompt's run prefers token 9 at its first step: it differs from there
    drift = [_output([1, 2, 3, 4], [-0.2, -0.2, -0.3, -0.4]),
             _output([9, 6], [-1.5, -1.0], top=[9, 6])]
    drift[1].outputs[0].logprobs[0][5] = SimpleNamespace(logprob=-2.0)
    got = _compare(base, drift)
    assert got["token_agreement"] == 5 / 6 and got["exact_outputs"] == 0.5
    assert got["mean_abs_dlogprob"] == pytest.approx((0.1 + 0 + 0 + 0 + 1.0) / 5)
