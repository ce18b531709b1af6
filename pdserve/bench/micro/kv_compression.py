"""``pdserve bench kv-compression``: the cluster KV store's block codecs
(``--kv-compression``) on real KV blocks of the default model, and on random ones.

For each ``--dtypes`` entry a child process (``kv_capture.py``) runs a vLLM engine of
the default model in that dtype over a few prompts of real text and saves
``--blocks`` full KV blocks; then, for each codec, every block is encoded and decoded
``--reps`` times (one block is one ``encode`` call, all layers, as a save does).
One JSON line per (data, dtype, mode): the compression ratio (raw bytes / payload
bytes), encode and decode ms per MiB of raw KV on one core (torch limited to one
thread): the CPU time of the thread (best repetition: the codec's own cost, whatever
else the machine runs) and the wall time (median), and for lossy modes the max and
mean absolute error, beside the data's mean |x| and the max error relative to the
value's head absmax (the bound: int8 1/254, fp8 1/16). And one ``"data": "engine"``
line per (dtype, mode): the engine's greedy outputs with every cached block passed
through the codec, against its outputs on the raw KV (``kv_capture.py``: token
agreement, whole outputs equal, mean |Δ logprob|, prefix-cached tokens per prompt).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.micro import RESULTS_DIR
from pdserve.bench.micro.configs import KvCompressionConfig
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression import codec_for

_MIB = 1 << 20
_CAPTURE_TIMEOUT_S = 900.0


def run(config: KvCompressionConfig) -> int:
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-kvz-") as tmp:
        for dtype in config.dtypes:
            try:
                captured = _capture(dtype, config, Path(tmp) / f"{dtype}.pt")
            except (RuntimeError, subprocess.SubprocessError) as exc:
                print(f"pdserve bench kv-compression: error: {exc}", file=sys.stderr)
                return 1
            for mode, quality in captured["quality"].items():
                lines.append(json.dumps({"data": "engine", "dtype": dtype, "mode": mode,
                                         "prompts": config.prompts} | {
                    k: round(v, 4) for k, v in quality.items()}))
                print(lines[-1], flush=True)
            sets = [("real", captured["layers"])]
            if config.random:
                gen = torch.Generator().manual_seed(0)
                sets.append(("random", [torch.randn(t.shape, generator=gen).to(t.dtype)
                                        for t in captured["layers"]]))
            for data, layers in sets:
                for mode in config.modes:
                    row = {"data": data, "dtype": dtype, "mode": mode,
                           "block_size": captured["block_size"],
                           **_measure(mode, layers, captured, config.reps)}
                    lines.append(json.dumps(row))
                    print(lines[-1], flush=True)
    out = Path(config.json) if config.json else \
        RESULTS_DIR / f"kv-compression-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(f"{line}\n" for line in lines))
    print(f"wrote {out}", file=sys.stderr)
    return 0


def _capture(dtype: str, config: KvCompressionConfig, path: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pdserve.bench.micro.kv_capture", dtype,
           str(config.prompts), str(config.blocks), ",".join(config.modes), str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CAPTURE_TIMEOUT_S,
                          check=False)
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"capturing {dtype} KV failed ({done.returncode}): "
                           f"{done.stderr[-2000:]}")
    captured: dict[str, Any] = torch.load(path)
    return captured


def _measure(mode: str, layers: Sequence[torch.Tensor], captured: dict[str, Any],
             reps: int) -> dict[str, object]:
    """Encode and decode every captured block ``reps`` times with codec ``mode``."""
    num_blocks = layers[0].shape[0]
    block_dim = 0 if len(captured["shapes"][0]) == 4 else 1
    caches = {f"layer.{i}": t.movedim(0, block_dim) for i, t in enumerate(layers)}
    layout = KVLayout.from_kv_caches(caches, num_blocks, captured["block_size"])
    codec = codec_for(mode, layout)
    blocks = [[t[b] for t in layers] for b in range(num_blocks)]
    outs = [[torch.empty_like(t[b]) for t in layers] for b in range(num_blocks)]
    enc: list[tuple[float, float]] = []
    dec: list[tuple[float, float]] = []
    payloads: list[bytes] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core: its CPU time is the codec's own cost
    try:
        for warm_up in (codec.encode(chunks) for chunks in blocks[:1]):
            codec.decode(warm_up, outs[0])
        for _ in range(reps):
            start = _clocks()
            payloads = [codec.encode(chunks) for chunks in blocks]
            enc.append(_since(start))
            start = _clocks()
            for payload, out in zip(payloads, outs, strict=True):
                codec.decode(payload, out)
            dec.append(_since(start))
    finally:
        torch.set_num_threads(threads)
    mib = sum(t.nbytes for t in layers) / _MIB
    row: dict[str, object] = {
        "blocks": num_blocks, "block_mib": round(mib / num_blocks, 3),
        "ratio": round(mib * _MIB / sum(len(p) for p in payloads), 3)}
    for op, times in (("encode", enc), ("decode", dec)):
        row[f"{op}_cpu_ms_per_mib"] = round(min(c for _, c in times) * 1e3 / mib, 3)
        row[f"{op}_wall_ms_per_mib"] = round(statistics.median(w for w, _ in times) * 1e3
                                             / mib, 3)
    return row | _errors(blocks, outs)


def _clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    wall, cpu = _clocks()
    return wall - start[0], cpu - start[1]


def _errors(blocks: Sequence[Sequence[torch.Tensor]],
            outs: Sequence[Sequence[torch.Tensor]]) -> dict[str, object]:
    worst = total = absolute = rel = 0.0
    count = 0
    for chunks, decoded in zip(blocks, outs, strict=True):
        for x, y in zip(chunks, decoded, strict=True):
            xf, err = x.float(), (x.float() - y.float()).abs()
            worst = max(worst, float(err.max()))
            total += float(err.double().sum())
            absolute += float(xf.abs().double().sum())
            count += err.numel()
            head = xf.abs().flatten(1).amax(dim=1) if xf.dim() == 3 else \
                xf.abs().amax(dim=(0, 1, 3))  # CPU: heads first; CUDA: (2, T, H, D)
            shape = (-1, *([1] * (xf.dim() - 1))) if xf.dim() == 3 else (1, 1, -1, 1)
            rel = max(rel, float((err / head.view(shape).clamp_min(1e-30)).max()))
    return {"max_abs_err": float(f"{worst:.4g}"), "mean_abs_err": float(f"{total / count:.4g}"),
            "mean_abs_value": float(f"{absolute / count:.4g}"),
            "max_err_per_head_absmax": float(f"{rel:.4g}")}
