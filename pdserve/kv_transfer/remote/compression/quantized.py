"""The lossy codecs: ``int8`` and ``fp8`` (``float8_e4m3fn``), each value divided by its
group's scale (``base.py``: per layer, token, head and K or V), the scales sent as
float32 beside the codes (4 bytes per ``head_dim`` codes: 6 % more than the codes at
``head_dim`` 64).

A group's scale is its absmax over the code's largest value (127 for int8, 448 for
e4m3), so the largest value is coded exactly at full range. The error per value:
int8 at most half a step, ``absmax / 254``; fp8 at most ``|x| / 16`` (3 mantissa bits)
and ``scale * 2**-10`` near zero (subnormals), so at most ``absmax / 16``. Values
decode as float32, then round to the layer's dtype (bf16 adds up to ``|x| / 256``).
An all-zero group has scale 0 and decodes as zeros. NaN or inf cannot be scaled: such
a block is refused (``ValueError``) and the caller does not store it.

Body: for each run of equal layers, its scales (float32, ``(count, groups)``), then its
codes (one byte each, in the chunks' own element order).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.kv_transfer.remote.compression.base import BlockPlan, LayerPlan, as_tensor, take

INT8_ID = 2
FP8_ID = 3


@dataclass(frozen=True)
class _Code:
    codec_id: int
    dtype: torch.dtype  # the codes' dtype, one byte
    top: float  # the largest code


INT8 = _Code(INT8_ID, torch.int8, 127.0)
FP8 = _Code(FP8_ID, torch.float8_e4m3fn, 448.0)


class QuantizedCodec:
    """Per-group absmax scaling to one-byte codes (``INT8`` or ``FP8``)."""

    def __init__(self, plan: BlockPlan, name: str, code: _Code) -> None:
        self._plan = plan
        self._code = code
        self.name = name

    def encode(self, chunks: Sequence[torch.Tensor]) -> bytes:
        parts: list[bytes | memoryview] = [self._plan.header(self._code.codec_id)]
        for (start, _), stack in zip(self._plan.runs, self._plan.stacked(chunks),
                                     strict=True):
            scales, codes = self._quantize(stack, self._plan.layers[start])
            parts += [scales.numpy().data, codes.view(torch.uint8).numpy().data]
        return b"".join(parts)

    def decode(self, payload: bytes | memoryview, out: Sequence[torch.Tensor]) -> None:
        body = self._plan.body(payload, self._code.codec_id)
        at, decoded = 0, []
        for start, n in self._plan.runs:
            lay = self._plan.layers[start]
            data, at = take(body, at, 4 * n * lay.num_groups)
            scales = as_tensor(data, torch.float32, (n, lay.num_groups))
            if not bool(torch.isfinite(scales).all()) or bool((scales < 0).any()):
                raise ValueError("a lossy KV payload with a corrupt scale")
            data, at = take(body, at, n * lay.numel)
            codes = as_tensor(data, self._code.dtype, (n, *lay.group_view))
            values = codes.to(torch.float32) * scales.view(_scale_shape(n, lay))
            decoded.append(values.to(lay.dtype).view(n, *lay.shape))
        if at != len(body):
            raise ValueError(f"a lossy KV payload body of {len(body)} bytes, the block "
                             f"needs {at}")
        self._plan.write(decoded, out)

    def _quantize(self, stack: torch.Tensor, lay: LayerPlan) -> tuple[torch.Tensor,
                                                                       torch.Tensor]:
        """The ``(count, groups)`` float32 scales and the codes of ``stack``."""
        n = stack.shape[0]
        x = stack.view(n, *lay.group_view).to(torch.float32)
        reduce = tuple(d + 1 for d in range(len(lay.group_view)) if d not in lay.keep)
        absmax = x.abs().amax(dim=reduce, keepdim=True) if reduce else x.abs()
        if not bool(torch.isfinite(absmax).all()):
            raise ValueError("a KV block with NaN or inf values cannot be quantized")
        scale = absmax / self._code.top
        inverse = torch.where(absmax > 0, self._code.top / absmax, torch.zeros_like(absmax))
        y = (x * inverse).clamp_(-self._code.top, self._code.top)
        if self._code.dtype == torch.int8:
            y = y.round_()
        return scale.reshape(n, -1).contiguous(), y.to(self._code.dtype).contiguous()


def _scale_shape(n: int, lay: LayerPlan) -> tuple[int, ...]:
    return (n, *(size if d in lay.keep else 1 for d, size in enumerate(lay.group_view)))
