"""The transport contract below the pdserve KV connector, and its registry.

A transport is one worker rank's end of KV transfers. It runs in vLLM's Worker
process, next to the KV tensors, on its own threads: connector methods run on
the engine's main thread and only submit work or poll results, never wait on
the network inside an engine step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from .layout import KVLayout
from .leases import LeaseTable


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer rank's KV endpoint listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


class KVTransport(Protocol):
    """Moves KV blocks between two workers' registered KV tensors.

    Ownership: the transport never frees or allocates blocks. On the sending
    side it reads blocks named by ``leases`` and ends the lease when a pull is
    done (or fails); the connector reports ended leases to the scheduler, which
    frees them. On the receiving side ``pull`` writes only into the
    ``dst_block_ids`` it is given; the caller owns them.

    Errors: every call is bounded by a deadline (``time.monotonic`` seconds) and
    raises ``wire.TransferError`` when a peer is gone, refuses, or is too slow;
    ``wire.IncompatiblePeerError`` when the handshake finds different layouts.
    """

    name: ClassVar[str]

    def start(
        self,
        *,
        kv_caches: Sequence[torch.Tensor],
        layout: KVLayout,
        leases: LeaseTable,
        compat: dict[str, Any],
        host: str,
        port: int,
    ) -> int:
        """Register the KV tensors and start serving on ``host:port``; returns the port."""
        ...

    def pull(
        self,
        peer: PeerAddress,
        remote_request_id: str,
        src_block_ids: Sequence[int],
        dst_block_ids: Sequence[int],
        deadline: float,
    ) -> int:
        """Copy the peer's ``src_block_ids`` of every layer into our ``dst_block_ids``.

        Ends the peer's lease for ``remote_request_id``. Returns bytes moved.
        """
        ...

    def release(self, peer: PeerAddress, remote_request_id: str, deadline: float) -> None:
        """Tell the peer to end its lease for ``remote_request_id`` without a transfer."""
        ...

    def stats(self) -> dict[str, int]:
        """Cumulative counters: bytes_sent, bytes_received, transfers_completed,
        transfers_failed, transfer_time_ns."""
        ...

    def close(self) -> None:
        """Stop serving and close every connection. Idempotent."""
        ...


_REGISTRY: dict[str, Callable[[], KVTransport]] = {}


def register_transport(name: str, factory: Callable[[], KVTransport]) -> None:
    _REGISTRY[name] = factory


def transport_names() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def create_transport(name: str) -> KVTransport:
    """Build a transport by name; an unknown name lists the valid ones."""
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown KV transport {name!r}; valid transports: {', '.join(sorted(_REGISTRY))}"
        ) from None
    return factory()


def _load_builtin() -> None:
    if "tcp" not in _REGISTRY:
        from .tcp import TcpTransport

        register_transport("tcp", TcpTransport)
