"""The KV tiers' eviction and admission policies (``tiers.policy.TierPolicy``), one
file each, made by name in ``registry``."""
