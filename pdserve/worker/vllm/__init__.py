"""The worker's vLLM side: ``engine.py`` (``AsyncLLM`` behind the ``Engine`` contract), the
plugin vLLM loads in its processes (``plugin.py``), its KV events (``kv_events.py``), its
connector's counters (``kv_status.py``) and in-place weight updates (``weights_ext.py``,
``gloo_transfer.py``)."""
