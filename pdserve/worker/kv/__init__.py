"""The worker's mirror of its engine's prefix-cached blocks (``mirror.py``) and the
KV-event relay over it (``relay.py``)."""
