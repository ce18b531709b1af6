"""``pdserve bench cache-sim``: a Mooncake-format trace replayed through the KV tiers'
own index and policies, one hit ratio per (policy, capacity)."""
