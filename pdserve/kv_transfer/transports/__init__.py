"""KV transports: how KV bytes move between engines (tcp, ucx, torch.distributed),
each behind the contract in ``kv_transfer/base.py``."""
