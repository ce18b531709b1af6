"""The local servers ``pdserve up`` starts beside its children (``--with-etcd``'s etcd,
``--with-redis``'s redis-server), kept alive: one that dies is started again on its port,
retried after the supervisor's longest back-off while it fails. Workers keep serving
meanwhile (on the router's last membership view; with every store call a miss)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from pdserve.launch.up_children import console

if TYPE_CHECKING:
    from pdserve.launch.up_store import LocalStore
    from pdserve.membership.local_etcd import LocalEtcd

__all__ = ["KeptServer", "LocalServer", "kept_servers"]


class LocalServer(Protocol):
    @property
    def proc(self) -> subprocess.Popen[bytes] | None: ...

    @property
    def url(self) -> str: ...


class KeptServer:
    """``server`` under ``name``; ``restart`` starts it again (same port; raises
    ``RuntimeError`` or ``OSError`` if it cannot); ``while_down`` says what still works."""

    def __init__(self, name: str, server: LocalServer, restart: Callable[[], object],
                 retry_s: float, while_down: str,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.name, self.server = name, server
        self._restart, self._retry_s, self._while_down = restart, retry_s, while_down
        self._clock = clock
        self.restarts = 0
        self.retry_at: float | None = None  # set while the server is down

    def keep(self) -> bool:
        """Start the server again if it died and it is time to try; whether anything
        changed."""
        now = self._clock()
        if self.retry_at is None:
            proc = self.server.proc
            if proc is not None and proc.poll() is None:
                return False
            console.print(f"[red]{self.name} exited[/]; {self._while_down}; restarting "
                          f"{self.name}")
            self.retry_at = now
        if now < self.retry_at:
            return False
        try:
            self._restart()
        except (RuntimeError, OSError) as exc:
            self.retry_at = now + self._retry_s
            console.print(f"[red]{self.name} restart failed[/]: {exc}")
            return True
        self.restarts += 1
        self.retry_at = None
        console.print(f"[green]{self.name} is back[/] at {self.server.url}")
        return True

    def row(self) -> tuple[str, str, str, str]:
        """Its line of ``up``'s status table: component, state, restarts, where."""
        state = "restarting" if self.retry_at is not None else "ready"
        return self.name, state, str(self.restarts), self.server.url


def kept_servers(retry_s: float, etcd: LocalEtcd | None,
                 store: LocalStore | None) -> list[KeptServer]:
    """The local servers up started, for its watch to restart when they die."""
    servers = []
    if etcd is not None:
        local_etcd = etcd

        def restart_etcd() -> None:  # same port and data
            local_etcd.stop(keep_data=True)
            local_etcd.start()

        servers.append(KeptServer("etcd", etcd, restart_etcd, retry_s,
                                  "workers keep serving on the router's last view"))
    if store is not None:
        servers.append(KeptServer("redis", store.server, store.server.restart, retry_s,
                                  "every KV store call is a miss"))
    return servers
