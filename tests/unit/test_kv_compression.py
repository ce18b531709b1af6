"""The store's block codecs (``--kv-compression``): none and lossless keep every bit
(NaN payloads, inf, -0.0 and subnormals too), int8 and fp8 stay within their per-group
error bounds, and a payload of another codec, version, shape or a damaged one is
refused, never misread."""

from __future__ import annotations

import math

import pytest
import torch
import zstandard

from pdserve.kv_transfer.config import KV_COMPRESSIONS
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression import CODECS, BlockCodec, codec_for
from pdserve.kv_transfer.remote.compression.base import HEADER_BYTES

BLOCKS, TOKENS, HEADS, HEAD_DIM, LAYERS = 4, 16, 3, 32, 3
CPU = (BLOCKS, HEADS, TOKENS, 2 * HEAD_DIM)  # vLLM's CPU backends
CUDA = (2, BLOCKS, TOKENS, HEADS, HEAD_DIM)  # flash-attention on a GPU
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
EPS = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _caches(shape: tuple[int, ...], dtype: torch.dtype, kind: str,
            seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in range(LAYERS):
        if kind == "random":
            t = torch.randn(shape, generator=gen) * (layer + 1)
        else:  # smooth along every dim, as real K/V along tokens
            grid = torch.stack(torch.meshgrid(*(torch.linspace(0, 1, n) for n in shape),
                                              indexing="ij")).sum(0)
            t = torch.sin(3 * grid + layer) * 4 + 0.01 * torch.randn(shape, generator=gen)
        out.append(t.to(dtype))
    return out


def _specials(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    caches = _caches(shape, dtype, "random")
    info = torch.finfo(dtype)
    values = [math.nan, math.inf, -math.inf, -0.0, 0.0, info.max, -info.max, info.tiny,
              info.tiny / 4]  # a subnormal
    for layer, t in enumerate(caches):
        flat = t.view(-1)
        for i, v in enumerate(values):
            flat[(i * 37 + layer) % flat.numel()] = v
        bits = flat.view(BITS[dtype])
        bits[5] = bits[0] | 1  # a NaN with another payload
    return caches


def _codec(name: str, caches: list[torch.Tensor]) -> BlockCodec:
    layout = KVLayout.from_kv_caches({f"layer.{i}": t for i, t in enumerate(caches)},
                                     BLOCKS, TOKENS)
    return codec_for(name, layout)


def _block(caches: list[torch.Tensor], shape: tuple[int, ...], b: int) -> list[torch.Tensor]:
    return [t[b] if shape == CPU else t[:, b] for t in caches]  # CUDA: not contiguous


def _round_trip(name: str, caches: list[torch.Tensor], shape: tuple[int, ...],
                ) -> tuple[list[torch.Tensor], bytes]:
    codec = _codec(name, caches)
    payload = codec.encode(_block(caches, shape, 1))
    target = [torch.full_like(t, 7.0) for t in caches]
    codec.decode(payload, _block(target, shape, 2))
    return _block(target, shape, 2), payload


def test_the_codec_names_are_the_flags_choices() -> None:
    assert CODECS == KV_COMPRESSIONS
    with pytest.raises(ValueError, match="valid: none, lossless, int8, fp8"):
        _codec("zip", _caches(CPU, torch.float32, "random"))


@pytest.mark.parametrize("name", ["none", "lossless"])
@pytest.mark.parametrize("shape", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "smooth", "specials"])
def test_lossless_is_bit_exact(name: str, shape: tuple[int, ...], dtype: torch.dtype,
                               kind: str) -> None:
    caches = _specials(shape, dtype) if kind == "specials" else _caches(shape, dtype, kind)
    got, _ = _round_trip(name, caches, shape)
    for want, have in zip(_block(caches, shape, 1), got, strict=True):
        assert torch.equal(want.contiguous().view(BITS[dtype]),
                           have.contiguous().view(BITS[dtype]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_lossless_shrinks_smooth_kv(dtype: torch.dtype) -> None:
    caches = _caches(CPU, dtype, "smooth")
    raw = sum(c.nbytes for c in _block(caches, CPU, 1))
    _, payload = _round_trip("lossless", caches, CPU)
    assert len(payload) < 0.85 * raw


def _group_max(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's group absmax: the ``head_dim`` values of one token's K or V of one
    head (both CPU conventions keep those contiguous; CUDA's last dim is one)."""
    if shape == CPU:
        v = x.abs().view(HEADS, TOKENS, 2, HEAD_DIM)
        return v.amax(dim=3, keepdim=True).expand_as(v).reshape(x.shape)
    return x.abs().amax(dim=3, keepdim=True).expand_as(x)


@pytest.mark.parametrize("name", ["int8", "fp8"])
@pytest.mark.parametrize("shape", [CPU, CUDA], ids=["cpu", "cuda"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["random", "smooth"])
def test_lossy_errors_stay_within_their_bounds(name: str, shape: tuple[int, ...],
                                               dtype: torch.dtype, kind: str) -> None:
    caches = _caches(shape, dtype, kind)
    for layer, t in enumerate(caches):  # groups 1000x apart: one shared scale would fail
        if shape == CPU:
            t.view(BLOCKS, HEADS, 2, -1)[:, :, 1] *= 1e-3 if layer % 2 else 1
            t[..., HEAD_DIM:] *= 1e-3 if layer % 2 == 0 else 1
        else:
            t[1] *= 1e-3
    got, payload = _round_trip(name, caches, shape)
    raw = sum(c.nbytes for c in _block(caches, shape, 1))
    numel = raw // dtype.itemsize  # one byte a value, a float32 scale per head_dim values
    assert len(payload) == HEADER_BYTES + numel + 4 * numel // HEAD_DIM
    for want, have in zip(_block(caches, shape, 1), got, strict=True):
        x, y = want.float(), have.float()
        amax = _group_max(x, shape)
        err = (x - y).abs()
        rounding = (amax * 1.01) * EPS[dtype]
        if name == "int8":
            bound = amax / 254 * (1 + 1e-5) + rounding
        else:
            bound = x.abs() / 16 + amax / 448 * 2.0**-9 + rounding
        assert bool((err <= bound).all()), float((err - bound).max())
        worst = (1 / 254 if name == "int8" else 1 / 15) + 1.01 * EPS[dtype]
        assert float((err / amax.clamp_min(1e-30)).max()) <= worst


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_lossy_keeps_zero_groups_and_refuses_nan(name: str) -> None:
    caches = _caches(CPU, torch.float32, "random")
    caches[0][1, 0].zero_()
    got, _ = _round_trip(name, caches, CPU)
    assert torch.equal(got[0][0], torch.zeros_like(got[0][0]))
    caches[1][1, 0, 0, 0] = math.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        _codec(name, caches).encode(_block(caches, CPU, 1))


@pytest.mark.parametrize("writer", CODECS)
@pytest.mark.parametrize("reader", CODECS)
def test_a_payload_of_another_codec_is_refused(writer: str, reader: str) -> None:
    caches = _caches(CPU, torch.float32, "random")
    payload = _codec(writer, caches).encode(_block(caches, CPU, 1))
    target = [torch.zeros_like(t) for t in caches]
    if writer == reader:
        _codec(reader, caches).decode(payload, _block(target, CPU, 0))
        return
    with pytest.raises(ValueError, match=f"encoded with '{writer}'"):
        _codec(reader, caches).decode(payload, _block(target, CPU, 0))
    assert all(bool((t == 0).all()) for t in target)  # nothing written


@pytest.mark.parametrize("name", CODECS)
def test_a_payload_of_another_shape_or_dtype_is_refused(name: str) -> None:
    caches = _caches(CPU, torch.float32, "random")
    payload = _codec(name, caches).encode(_block(caches, CPU, 1))
    others = [_caches(CPU, torch.bfloat16, "random"),
              _caches((BLOCKS, HEADS + 1, TOKENS, 2 * HEAD_DIM), torch.float32, "random"),
              _caches(CPU, torch.float32, "random")[:2]]
    for other in others:
        with pytest.raises(ValueError, match="another block shape or dtype"):
            _codec(name, other).decode(payload, _block(other, CPU, 0))
    with pytest.raises(ValueError, match="layer 0"):  # the right payload, a wrong target
        _codec(name, caches).decode(payload, _block(others[1], CPU, 0))
    with pytest.raises(ValueError, match="layer 0"):  # chunks that are not the layout's
        _codec(name, caches).encode(_block(others[0], CPU, 0))


@pytest.mark.parametrize("name", CODECS)
def test_a_cut_or_a_damaged_header_is_refused(name: str) -> None:
    caches = _caches(CPU, torch.bfloat16, "smooth")
    codec = _codec(name, caches)
    payload = codec.encode(_block(caches, CPU, 1))
    out = _block([torch.zeros_like(t) for t in caches], CPU, 0)
    for cut in (0, HEADER_BYTES - 1, HEADER_BYTES, len(payload) // 2, len(payload) - 1):
        with pytest.raises(ValueError):
            codec.decode(payload[:cut], out)
    with pytest.raises(ValueError):
        codec.decode(payload + b"\0", out)
    for at in range(HEADER_BYTES):
        bad = bytearray(payload)
        bad[at] ^= 0x10
        with pytest.raises(ValueError):
            codec.decode(bytes(bad), out)
    # past the header, lossless refuses damage (below); the others' bodies are checked
    # by the store's value frame (codec.py: a CRC over the whole payload)


def test_lossless_refuses_a_flipped_bit_anywhere_or_decodes_it_exactly() -> None:
    caches = _caches(CPU, torch.bfloat16, "smooth")
    codec = _codec("lossless", caches)
    want = _block(caches, CPU, 1)
    payload = codec.encode(want)
    out = _block([torch.zeros_like(t) for t in caches], CPU, 0)
    refused = 0
    for at in range(len(payload)):
        bad = bytearray(payload)
        bad[at] ^= 1 << (at % 8)
        try:
            codec.decode(bytes(bad), out)
        except ValueError:
            refused += 1
            continue
        # a bit zstd's frame does not use: the same bytes, never others
        assert all(torch.equal(w.view(torch.int16), o.view(torch.int16))
                   for w, o in zip(want, out, strict=True)), at
    assert refused > 0.99 * len(payload)  # the rest decoded the same bytes


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_lossy_refuses_a_corrupt_scale(name: str) -> None:
    caches = _caches(CPU, torch.float32, "random")
    codec = _codec(name, caches)
    bad = bytearray(codec.encode(_block(caches, CPU, 1)))
    bad[HEADER_BYTES:HEADER_BYTES + 4] = torch.tensor([math.nan]).numpy().tobytes()
    with pytest.raises(ValueError, match="corrupt scale"):
        codec.decode(bytes(bad), _block([torch.zeros_like(t) for t in caches], CPU, 0))


def test_lossless_refuses_a_frame_larger_than_the_block() -> None:
    caches = _caches(CPU, torch.float32, "random")
    codec = _codec("lossless", caches)
    payload = codec.encode(_block(caches, CPU, 1))
    raw = sum(t[1].nbytes for t in caches)
    out = _block([torch.zeros_like(t) for t in caches], CPU, 0)
    for size in (raw + 1, 64 * raw):  # a planted value: the right header, a bomb behind it
        bomb = zstandard.ZstdCompressor().compress(bytes(size))
        with pytest.raises(ValueError, match=f"declaring {size} bytes"):
            codec.decode(payload[:HEADER_BYTES] + bomb, out)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    frame = unsized.compress(bytes(raw)) + unsized.flush()
    with pytest.raises(ValueError, match="declaring -1 bytes"):  # no size: refused too
        codec.decode(payload[:HEADER_BYTES] + frame, out)
