"""The block codecs on a CUDA KV cache (flash-attention's ``(2, blocks, block_size,
kv_heads, head_dim)``): chunks read from and decoded into the device's cache (through
the CPU), lossless bit-exact, int8 within its bound."""

from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.remote.compression import codec_for

pytestmark = pytest.mark.gpu  # skipped where there is no device (tests/conftest.py)

BLOCKS, TOKENS, HEADS, HEAD_DIM = 4, 16, 2, 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_codecs_round_trip_a_cuda_cache(dtype: torch.dtype) -> None:
    caches = [torch.randn(2, BLOCKS, TOKENS, HEADS, HEAD_DIM, device="cuda").to(dtype)
              for _ in range(3)]
    layout = KVLayout.from_kv_caches({f"layer.{i}": c for i, c in enumerate(caches)},
                                     BLOCKS, TOKENS)
    assert layout.device == "cuda"
    for name in ("lossless", "int8"):
        codec = codec_for(name, layout)
        payload = codec.encode([c[:, 1] for c in caches])
        codec.decode(payload, [c[:, 3] for c in caches])
        for c in caches:
            if name == "lossless":
                assert torch.equal(c[:, 1].view(torch.int16), c[:, 3].view(torch.int16))
            else:
                amax = c[:, 1].float().abs().amax(dim=-1, keepdim=True)
                err = (c[:, 1].float() - c[:, 3].float()).abs()
                assert bool((err <= amax / 254 * 1.01 + amax * 2.0**-7).all())
