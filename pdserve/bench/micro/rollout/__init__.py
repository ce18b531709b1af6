"""``pdserve bench rollout``: the RL rollout loop (generate, refit, repeat), its HTTP
client and its accounting; ``pdserve bench rollout-lora`` (``lora_*.py``): the same loop
with a LoRA policy and adapter refits, on pdserve and on one ``vllm serve``."""
