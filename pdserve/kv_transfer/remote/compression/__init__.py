"""How a KV block is encoded in the cluster store and the KV pool (``--kv-compression``):
``base`` (the ``BlockCodec`` contract, the payload header, each layer's scale groups),
``plain`` (none, and lossless: byte planes + zstd), ``quantized`` (int8 and fp8 with
per-head scales) and ``registry`` (``codec_for``)."""

from pdserve.kv_transfer.remote.compression.base import CODECS, BlockCodec, encoding_tag
from pdserve.kv_transfer.remote.compression.registry import codec_for

__all__ = ["CODECS", "BlockCodec", "codec_for", "encoding_tag"]
