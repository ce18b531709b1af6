"""``pdserve bench rollout``: the RL rollout loop (generate, refit, repeat), its HTTP
client and its accounting."""
