"""``pdserve up`` after its plan: run the children under a ``Supervisor``, wait until
the cluster can serve, then keep it serving.

A child that exits (crash, OOM kill, SIGKILL) is restarted on the same ports and
cores (``pdserve/launch/supervisor.py``: back-off, give-up); the others keep serving
meanwhile. With static membership the router's view already names the worker's
endpoint and takes it back once its health check passes; with etcd the worker
registers again. The cluster stops (exit 1) only when the router, or every decode
worker, has been given up on: nothing could serve then. A local etcd
(``--with-etcd``) that dies is started again on its port and data.

Start-up waits for every child; past ``--startup-timeout-s`` it still serves if
the router sees a healthy decode worker (the others keep being supervised),
else it fails.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from rich.live import Live
from rich.table import Table

from pdserve.core import process
from pdserve.core.cluster_secret import ClusterSecret
from pdserve.core.grpc_tls import GrpcTls
from pdserve.launch.supervisor import ChildEvent, ChildSpec, RestartPolicy, Supervisor
from pdserve.launch.up_children import Child, child_env, console, probe_child, tail
from pdserve.launch.up_servers import KeptServer

_POLL_S = 0.5
# While starting: a probe costs ~1 ms (``up_children``), and a user (or a test) waits for
# the endpoint line.
_STARTUP_POLL_S = 0.1
_LOG_TAIL_LINES = 12


class ClusterWatch:
    """The children of one ``pdserve up``, supervised; the caller's thread drives it
    (``start``, ``wait_servable``, ``serve``, ``stop``)."""

    def __init__(self, children: Sequence[Child], policy: RestartPolicy,
                 servers: Sequence[KeptServer] = (), secret: ClusterSecret | None = None,
                 tls: GrpcTls | None = None) -> None:
        self.children = {c.name: c for c in children}
        self._secret, self._tls = secret, tls  # what workers are probed with
        specs = [ChildSpec(c.name, c.argv, c.log, c.env) for c in children]
        self.supervisor = Supervisor(specs, policy, child_env())
        self.servers = tuple(servers)  # local etcd, local redis-server: kept alive

    def start(self) -> None:
        self.supervisor.start()

    def stop(self, grace_s: float) -> None:
        self.supervisor.stop(grace_s)

    def wait_servable(self, timeout_s: float) -> None:
        """Until every child still supervised is ready; after ``timeout_s``, until the
        router is up with a healthy decode worker. ``RuntimeError`` if neither, or
        once nothing can serve (``fatal``). Polled by ``pdserve.core.process.wait_ready``."""
        started = time.monotonic()
        with Live(self.table("starting", started), console=console,
                  refresh_per_second=2) as live:

            def probe() -> str:
                self.step()
                live.update(self.table("starting", started))
                return self.fatal() or ", ".join(self._not_ready())  # fatal: never ready

            try:
                process.wait_ready(probe, timeout_s, exited=self.fatal, interval_s=_STARTUP_POLL_S,
                                   retry_on=())  # a failing step is no "not ready yet"
                return
            except process.NotReadyError:
                fatal = self.fatal()
                if fatal:
                    raise RuntimeError(fatal) from None
                if self._router().num_healthy_decode == 0:
                    raise RuntimeError(f"no decode worker ready after {timeout_s:.0f}s") from None
            console.print(f"[yellow]not ready after {timeout_s:.0f}s[/]: "
                          f"{', '.join(self._not_ready())}; serving with the rest")

    def _not_ready(self) -> list[str]:
        """The children still supervised that are not ready."""
        return [c.name for c in self.children.values()
                if not self._gave_up(c) and c.state != "ready"]

    def serve(self) -> int:
        """Supervise until a stop signal (``KeyboardInterrupt``, raised by the caller's
        handler) or until nothing can serve (returns 1). Prints each exit, restart and
        return to ready, then the status table."""
        while True:
            if self.step():
                console.print(self.table("status"))
            fatal = self.fatal()
            if fatal:
                console.print(f"[red]{fatal}[/]; stopping pdserve")
                return 1
            time.sleep(_POLL_S)

    def step(self) -> bool:
        """Act on the supervisor's events, restart a local server that died, probe the children
        not ready yet. Whether anything changed."""
        changed = False
        for event in self.supervisor.poll():
            self._on_event(event)
            changed = True
        for server in self.servers:
            changed |= server.keep()
        router = self._router()
        router.extra["num_workers"] = str(sum(
            1 for c in self.children.values() if c is not router and not self._gave_up(c)))
        for child in self.children.values():
            sup = self.supervisor.children[child.name]
            if child.state == "ready" or not sup.running:
                continue
            if probe_child(child, self._secret, self._tls):
                changed = True
                if sup.num_restarts:
                    console.print(f"[green]{child.name} is back[/] (restart {sup.num_restarts})")
        return changed

    def _on_event(self, event: ChildEvent) -> None:
        child = self.children[event.name]
        if event.kind == "exited":
            child.state = f"exited ({event.returncode}), restart in {event.delay_s:.0f}s"
            console.print(f"[red]{event.name} exited ({event.returncode})[/]; restarting in "
                          f"{event.delay_s:.1f}s. Log: {child.log}\n"
                          + tail(child.log, _LOG_TAIL_LINES))
        elif event.kind == "restarted":
            child.state = "restarting"
        else:
            p = self.supervisor.policy
            child.state = "gave up"
            console.print(f"[red]{event.name} failed {p.max_restarts + 1} times within "
                          f"{p.window_s:.0f}s; not restarting it again[/]. Log: {child.log}\n"
                          + tail(child.log, _LOG_TAIL_LINES))

    def fatal(self) -> str | None:
        """Why nothing can serve any more, or None."""
        if self._gave_up(self._router()):
            return "the router keeps failing"
        decode = [c for c in self.children.values() if c.name.startswith("decode-")]
        if decode and all(self._gave_up(c) for c in decode):
            return "no decode worker left: every one keeps failing"
        return None

    def table(self, what: str, started: float | None = None) -> Table:
        since = f" ({time.monotonic() - started:.0f}s)" if started is not None else ""
        table = Table(title=f"pdserve {what}{since}")
        for column in ("component", "state", "restarts", "log"):
            table.add_column(column)
        for c in self.children.values():
            table.add_row(c.name, c.state, str(self.supervisor.children[c.name].num_restarts),
                          str(c.log))
        for server in self.servers:
            table.add_row(*server.row())
        return table

    def num_restarts(self) -> dict[str, int]:
        return {name: c.num_restarts for name, c in self.supervisor.children.items()}

    def _router(self) -> Child:
        return self.children["router"]

    def _gave_up(self, child: Child) -> bool:
        return self.supervisor.children[child.name].gave_up
