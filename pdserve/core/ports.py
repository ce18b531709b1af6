"""Free TCP ports for processes that bind them later (workers, etcd, test clusters).

A port is free when it is picked, not when it is bound: ``up`` picks a dozen for its
children before any of them binds one. So this process never hands out the same port
twice, nor one that ``reserve`` named (ports given on the command line that a child
will bind): without that, two workers of one cluster could be handed the same port,
and the one that loses the race restarts onto it again and again."""

from __future__ import annotations

import random
import socket

# Below Linux's default ephemeral range (32768-60999): a port handed out here for a
# process to bind seconds or minutes later cannot meanwhile become the source port
# of some outgoing connection (vLLM engines open many while they start).
_RANGE = (20000, 32000)
_handed: set[int] = set()  # handed out or reserved by this process


def reserve(*ports: int) -> None:
    """Never hand out ``ports`` (0 is ignored): this process's children will bind them."""
    _handed.update(p for p in ports if p)


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(200):
        port = random.randint(*_RANGE)
        if port in _handed:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
        _handed.add(port)
        return port
    for _ in range(200):  # the range is crowded: let the kernel choose
        with socket.socket() as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in _handed:
            _handed.add(port)
            return port
    raise OSError("no free TCP port: every one the kernel offered was handed out already")
