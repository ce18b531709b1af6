"""The trainer side of ``test_gloo_transfer.py``, in a module a spawned process can
import (``unit.gloo_trainer``: tests/ is on its sys.path, as on the parent's); a test
module is imported under a name a child cannot (``--import-mode=importlib``)."""

from __future__ import annotations

import torch

from pdserve.worker.vllm.gloo_transfer import GlooTrainer

TENSORS = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
           "b.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16)}


def trainer_main(port: int) -> None:
    trainer = GlooTrainer.open("127.0.0.1", port, world_size=2, timeout_s=60)
    trainer.send(sorted(TENSORS.items()))
    trainer.close()
