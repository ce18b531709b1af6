"""A worker's LoRA adapters: which it serves under which name (``adapters.py``) and
the host's part in its engine (``host.py``)."""
