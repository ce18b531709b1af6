"""KV tiers below the engine's memory: the host tier (pinned CPU memory) and the disk
tier, their index and plan on the scheduler side and their store on the worker side."""
