"""Graceful drain on SIGTERM: stop admitting, let in-flight requests finish, then exit.

uvicorn's own SIGTERM handling closes the listening socket at once and gives running
requests ``timeout_graceful_shutdown``; a load balancer then sees refused connections
instead of a 503 from ``/health``. ``DrainingServer`` takes the first SIGTERM itself:
admission starts draining (new generation requests and ``/health`` get 503, the socket
stays open so they can be told), and uvicorn is asked to exit once the running requests
are done or ``drain_timeout_s`` has passed. A second SIGTERM, or SIGINT, is uvicorn's:
exit now. The process exits with status 0 after a drain (uvicorn would otherwise re-raise
the signal once serving ends, which skips the router's own cleanup).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import Sequence
from types import FrameType

import uvicorn

from pdserve.router.http.edge.admission import Admission

logger = logging.getLogger("pdserve.router")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission, drain_timeout_s: float,
                 companions: Sequence[uvicorn.Server] = ()) -> None:
        """``companions`` (the admin listener) exit with this server."""
        super().__init__(config)
        self._admission = admission
        self._drain_timeout_s = drain_timeout_s
        self._companions = tuple(companions)
        self._drain: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            await super().serve(sockets)
        finally:
            for companion in self._companions:
                companion.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self._drain is None and self._loop is not None:
            self._loop.call_soon_threadsafe(self.start_drain)
            return
        super().handle_exit(sig, frame)

    def start_drain(self) -> None:
        """What the first SIGTERM does (callable from the loop, e.g. by tests)."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit())

    async def _drain_then_exit(self) -> None:
        admission = self._admission
        logger.info("draining: %d running, %d queued; waiting up to %.0f s",
                    admission.num_running, admission.num_waiting, self._drain_timeout_s)
        admission.start_drain()
        if await admission.wait_drained(self._drain_timeout_s):
            logger.info("drained: every in-flight request finished")
        else:
            logger.warning("drain timeout: %d requests still running are cut off",
                           admission.num_running)
        self.should_exit = True
