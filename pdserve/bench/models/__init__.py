"""What the benches and tests write to serve: perturbed checkpoints (``checkpoints.py``)
and small LoRA adapters (``lora_adapters.py``)."""
