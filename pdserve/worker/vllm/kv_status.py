"""The KV connector's own counters, as a vLLM worker reads them: a ``status`` request to
its KV endpoint in the engine's Worker process (``VllmEngine.kv_status``)."""

from __future__ import annotations

import logging
from typing import Any

from pdserve.kv_transfer.config import ConnectorConfig
from pdserve.kv_transfer.control.dial import request_once
from pdserve.kv_transfer.control.wire import TransferError

logger = logging.getLogger("pdserve.worker")

# Under the router's probe deadline (2 s), with room for the engine counters.
KV_STATUS_TIMEOUT_S = 1.0


class ConnectorStatus:
    """Asks ``connector``'s KV endpoint for its counters; keeps the last reply, so they
    never go back to zero because one reply was late (GetLoad answers within the
    router's probe deadline)."""

    def __init__(self, connector: ConnectorConfig) -> None:
        self._connector = connector
        self._last: dict[str, Any] = {}

    def read(self) -> dict[str, Any]:
        """The connector's counters, or its last reply if this one is late or fails
        (blocking)."""
        connector = self._connector
        tls = connector.kv_tls()
        host = kv_status_host(connector.kv_bind_host, connector.kv_host, tls is not None)
        try:
            self._last = request_once(host, connector.kv_port, {"op": "status"},
                                      KV_STATUS_TIMEOUT_S, connector.cluster_secret(), tls)
        except TransferError as exc:
            logger.warning("KV endpoint status unavailable (reporting the last): %s", exc)
        return self._last


def kv_status_host(bind_host: str, advertised_host: str, tls: bool) -> str:
    """Where this worker reaches its own KV endpoint: the advertised host under TLS (its
    certificate names that host, maybe not loopback); else loopback when the endpoint
    listens on every address, or the one address it listens on (``--host 10.0.0.7``:
    nothing answers on loopback there)."""
    if tls:
        return advertised_host
    if bind_host in ("", "0.0.0.0", "::"):
        return "::1" if bind_host == "::" else "127.0.0.1"
    return bind_host
