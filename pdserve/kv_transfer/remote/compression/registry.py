"""``codec_for(name, layout)``: the ``BlockCodec`` of a ``--kv-compression`` name for
one worker's KV layout; an unknown name fails listing the valid ones."""

from __future__ import annotations

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression.base import BlockCodec, BlockPlan, check_name
from pdserve.kv_transfer.remote.compression.plain import LosslessCodec, NoneCodec
from pdserve.kv_transfer.remote.compression.quantized import FP8, INT8, QuantizedCodec


def codec_for(name: str, layout: KVLayout) -> BlockCodec:
    """The codec ``name`` (one of ``CODECS``) for blocks of ``layout``."""
    check_name(name)
    plan = BlockPlan.of(layout)
    if name == "none":
        return NoneCodec(plan)
    if name == "lossless":
        return LosslessCodec(plan)
    return QuantizedCodec(plan, name, INT8 if name == "int8" else FP8)
