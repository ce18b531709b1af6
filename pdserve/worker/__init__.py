"""The worker core both roles share: the hosted engine (``engine``,
``vllm_engine``), the host that serves one phase of a request on it (``host``),
the per-role ``RolePolicy`` contract it delegates to (``policy``; the roles live
in ``prefill_worker/`` and ``decode_worker/``), the ``WorkerBackend`` contract
(``backend``), the gRPC adapter (``servicer``) and the process (``serve``)."""
