"""KV transfer between engines: pdserve's vLLM KV connector
(``connector.py``: its scheduler side and worker side), the transport contract and
registry (``base.py``), the transports (tcp, ucx, torch.distributed), layer-wise push,
leases and integrity.

Loaded by vLLM inside its engine processes (``kv_connector_module_path``); imports only
``pdserve.core``.
"""
