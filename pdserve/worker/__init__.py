"""The worker core both roles share: the hosted engine (``engine``,
``vllm_engine``), the host that serves one phase of a request on it (``host``),
the per-role ``RolePolicy`` contract it delegates to (``policy``; the roles live
in ``roles/prefill/`` and ``roles/decode/``, which sit on this package and are never
imported by it), the ``WorkerBackend`` contract (``backend``), the gRPC adapter
(``servicer``), the engine's KV mirror and its relay to the router (``kv_mirror``,
``kv_relay``, ``vllm_kv_events``) and the simulated engine (``sim_engine``). The process
that wires a host to its role is ``pdserve.launch.serve_worker``."""
