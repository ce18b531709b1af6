"""Bad input on every port: fuzzers for the KV port (``pdserve bench fuzz``) and the
router's HTTP bodies.

``kv_inputs`` makes seeded inputs for a KV control port (random bytes, truncated and
malformed frames, ops before the handshake, auth garbage, pulls of unknown requests,
pushes out of range, stalled connections); ``kv_driver`` sends them, one connection
each, and reads what the server answers; ``kv_target`` is a live transport on fake KV
tensors in this process (or a worker's port, ``kv_remote``) that says whether a server
thread died, a lease or an inbox block leaked, and whether a real pull and push still
work afterwards; ``report`` prints the table.
"""
