"""Free TCP ports for processes that bind them later (workers, etcd, test clusters)."""

from __future__ import annotations

import random
import socket

# Below Linux's default ephemeral range (32768-60999): a port handed out here for a
# process to bind seconds or minutes later cannot meanwhile become the source port
# of some outgoing connection (vLLM engines open many while they start).
_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(200):
        port = random.randint(*_RANGE)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is crowded: let the kernel choose
        s.bind((host, 0))
        return int(s.getsockname()[1])
