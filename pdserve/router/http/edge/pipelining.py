"""uvicorn's httptools protocol, telling every request of a connection that its client
left, not only the newest.

Under HTTP/1.1 pipelining a client sends its next request before the answer to the one
before: uvicorn queues the new request's cycle and makes it the connection's
``cycle``, while the earlier one runs on. When the client then closes, uvicorn's
``connection_lost`` marks only ``cycle`` (the queued one, never started) disconnected:
the running request's ``receive`` never answers ``http.disconnect``, so its generation
(``cancellation.until_disconnect``, Starlette's disconnect listener) runs to its end
for nobody. This protocol also marks every earlier cycle of the connection that has
not completed, and wakes its ``receive``, so the request is aborted on the workers as
for a client that leaves without pipelining.

It reads what the stream writer reads (``openai/stream_writer.py``) of uvicorn's cycle
(``response_complete``, ``disconnected``) and its ``message_event``, under the
versions ``pyproject.toml`` pins; ``pdserve router`` serves its main port with it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class PipelinedHttpToolsProtocol(HttpToolsProtocol):
    """``HttpToolsProtocol`` whose ``connection_lost`` reaches every unfinished cycle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._unfinished: list[Any] = []  # this connection's cycles, oldest first

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and (not self._unfinished or self._unfinished[-1] is not cycle):
            self._unfinished = [c for c in self._unfinished if not c.response_complete]
            self._unfinished.append(cycle)

    def connection_lost(self, exc: Exception | None) -> None:
        for cycle in self._unfinished:
            if cycle is not self.cycle and not cycle.response_complete:
                cycle.disconnected = True
                event: asyncio.Event = cycle.message_event
                event.set()
        self._unfinished = []
        super().connection_lost(exc)
