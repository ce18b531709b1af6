"""The tests' random LoRA adapters: the bench's generator (``pdserve.bench.models.lora_adapters``),
re-exported under the name the tests import."""

from pdserve.bench.models.lora_adapters import TARGETS, make_adapter

__all__ = ["TARGETS", "make_adapter"]
