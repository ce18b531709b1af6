"""The transport contract below the pdserve KV connector, and its registry.

A transport is one worker rank's end of KV transfers. It runs in vLLM's Worker
process, next to the KV tensors, on its own threads: connector methods run on
the engine's main thread and only submit work or poll results, never wait on
the network inside an engine step.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pdserve.kv_transfer.links import DEFAULT_MAX_AGE_S

if TYPE_CHECKING:  # kept out of import time: the CLI lists transports without torch
    import torch

    from pdserve.core.cluster_secret import ClusterSecret
    from pdserve.kv_transfer.control.tls import KvTls
    from pdserve.kv_transfer.layout import KVLayout
    from pdserve.kv_transfer.leases import LeaseTable
    from pdserve.kv_transfer.push.inbox import PushInbox
    from pdserve.kv_transfer.remote.compression import BlockCodec


@dataclass(frozen=True)
class PeerAddress:
    """Where a peer rank's KV endpoint listens."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True)
class TransportOptions:
    """Settings every transport honours.

    ``checksum``: the sender checksums each transfer's bytes and the receiver
    verifies them; a mismatch fails the pull with ``wire.TransferError`` (the
    connector then reports a failed load and vLLM recomputes), never wrong KV.
    ``throttle_bytes_per_s``: pace the sending side to at most this rate (0: off);
    emulates a slower link for benchmarks and makes mid-transfer faults testable.
    ``secret``: the cluster secret; with it, every control connection (and so
    every transfer, whichever transport moves the bytes) starts with a mutual
    challenge-response (``auth.py``), and a peer without it gets no KV byte.
    None: anyone who reaches the port is trusted (as before).
    ``tls``: mutual TLS on every control connection (``tls.py``), and so on the
    tcp transport's KV bytes; a peer without a certificate the CA signed is refused
    before its first message. None: plaintext.
    ``idle_timeout_s``: the server closes a control connection that sends nothing this
    long, between messages or inside one (a stalled peer holds no thread for longer);
    clients reuse theirs for half of it. None: ``control/server.IDLE_TIMEOUT_S``.
    ``stall_s``: a pull fails once its peer has sent no byte for this long (or has not
    answered its connect), not only at its deadline: a cut link or a frozen peer costs
    the decode this, then it recomputes the prompt (the first reply may take
    ``LEASE_WAIT_S`` more: the peer waits for a lease announced late). None: the
    deadline only.
    ``link_max_age_s``: how long the rate measured to a peer (``links.py``) is believed
    without a new pull from it.
    ``handoff_lossy``: a lossy pool codec (``int8``, ``fp8``) encodes P->D handoffs too,
    where that pays (``coded_pull.py``); False: only ``lossless`` does.
    ``max_connections``: control connections the server serves at once; one more is
    closed on accept and counted as a refusal. None: ``control/server.MAX_CONNECTIONS``.
    ``max_logins``: of those, how many may still be authenticating (with a secret or
    TLS); one more ends the oldest. None: ``control/server.MAX_LOGINS``.
    """

    checksum: bool = False
    throttle_bytes_per_s: float = 0.0
    secret: ClusterSecret | None = field(default=None, repr=False)
    tls: KvTls | None = field(default=None, repr=False)
    idle_timeout_s: float | None = None
    stall_s: float | None = None
    link_max_age_s: float = DEFAULT_MAX_AGE_S
    handoff_lossy: bool = False
    max_connections: int | None = None
    max_logins: int | None = None

    def __post_init__(self) -> None:
        if self.throttle_bytes_per_s < 0:
            raise ValueError(f"throttle_bytes_per_s must be >= 0, got {self.throttle_bytes_per_s}")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"idle_timeout_s must be > 0, got {self.idle_timeout_s}")
        if not self.link_max_age_s > 0:
            raise ValueError(f"link_max_age_s must be > 0, got {self.link_max_age_s}")
        if self.stall_s is not None and not self.stall_s > 0:
            raise ValueError(f"stall_s must be > 0, got {self.stall_s}")
        for name, value in (("max_connections", self.max_connections),
                            ("max_logins", self.max_logins)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")


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

        Ends the peer's lease for ``remote_request_id``. Returns bytes moved (on the
        wire: fewer than the blocks hold when they travelled encoded, ``use_pool_codec``).
        ``TransferError`` when the peer is gone, refuses, or the bytes fail their check;
        a peer that refuses only the encoding is pulled raw in the same call.
        """
        ...

    def release(self, peer: PeerAddress, remote_request_id: str, deadline: float) -> None:
        """Tell the peer to end its lease for ``remote_request_id`` without a transfer."""
        ...

    def pull_pool(self, peer: PeerAddress, hashes: Sequence[bytes],
                  dst_block_ids: Sequence[int], deadline: float) -> int:
        """The cluster KV pool: copy the blocks named ``hashes`` (vLLM's prefix-cache
        hashes) from the peer's host tier into our ``dst_block_ids``. Returns bytes
        moved (encoded ones under a codec); ``TransferError`` if the peer no longer
        holds one of them, is gone, or a block was rewritten while it was sent or does
        not decode (nothing is then usable); ``IncompatiblePeerError`` if the peer
        encodes its pool otherwise (``use_pool_codec``)."""
        ...

    def serve_pool(self, source: Callable[[list[bytes]], Any]) -> None:
        """Serve peers' ``pull_pool`` from ``source`` (``pool_pull.PoolServeSource``: the
        host tier, which owns the bytes; the transport only reads them while it
        sends). Without a source, pool pulls are refused."""
        ...

    def use_pool_codec(self, codec: BlockCodec) -> None:
        """Encode the pool's blocks with ``codec`` (``--kv-compression``; before
        ``start``): ``pull_pool`` asks for that encoding and decodes what it gets, and
        a peer's pull that asks for another is refused (``IncompatiblePeerError`` on
        that peer; counted here as ``pool_serve_refusals``). Without a call, or with
        ``none``, the pool moves the cache's raw bytes. The same codec encodes the P->D
        handoff where that is estimated faster on the path (``coded_pull.py``): a
        ``pull`` may then move fewer bytes than the blocks hold."""
        ...

    def stats(self) -> dict[str, int]:
        """Cumulative counters: bytes_sent, bytes_received, transfers_completed,
        transfers_failed, transfer_time_ns, pool_serve_refusals; and of the pulls
        made here, encoded_pulls, encoded_bytes_saved and encoded_pull_refusals."""
        ...

    def add_status(self, source: Callable[[], dict[str, int]]) -> None:
        """More counters for peers that ask this endpoint its status (the
        connector's load and push counters); ``source`` runs on a serving thread."""
        ...

    def push_channel(self) -> PushChannel | None:
        """This transport's layer-wise push, or None if it cannot push (then
        the decode always pulls). Registered with ``can_push`` to match."""
        ...

    def close(self) -> None:
        """Stop serving and close every connection. Idempotent."""
        ...


class PushChannel(Protocol):
    """Layer-wise push: a prefill sends each layer's blocks into a decode's
    inbox as soon as its forward pass wrote them, before the decode asks.

    Ownership: the decode's connector owns its ``PushInbox`` (creates it, sizes
    it, drops entries no load will take) and hands it over with
    ``accept_pushes`` before ``start``; the transport only writes pushed bytes
    into it. On the prefill, a push reads blocks still held under the request's
    lease and never ends that lease: the decode's load or release does.

    Errors: ``push`` and ``push_abort`` raise ``wire.TransferError`` when the
    peer is gone, too slow for ``deadline``, or refuses (no inbox, inbox full,
    a shape that does not fit). None is fatal to the request: the prefill stops
    pushing that transfer, tells the decode with ``push_abort``, and the decode
    pulls the blocks instead.
    """

    def accept_pushes(self, inbox: PushInbox) -> None:
        """Decode: store pushed KV in ``inbox`` (without one, pushes are refused)."""
        ...

    def push(
        self, peer: PeerAddress, transfer_id: str, layer: int, first_position: int,
        block_ids: Sequence[int], num_blocks: int, final: bool, deadline: float,
        checksum: bool = False,
    ) -> int:
        """Send our ``block_ids`` of ``layer`` into the peer's inbox at positions
        ``first_position …`` of ``transfer_id``; returns payload bytes."""
        ...

    def push_abort(self, peer: PeerAddress, transfer_id: str, why: str, deadline: float) -> None:
        """Tell the peer that ``transfer_id`` will not be pushed further."""
        ...


@dataclass(frozen=True)
class _Builtin:
    target: str  # "module:Class", imported only when one is created (ucxx, torch)
    can_push: bool


_BUILTIN = {"tcp": _Builtin(".transports.tcp:TcpTransport", can_push=True),
            "ucx": _Builtin(".transports.ucx:UcxTransport", can_push=False),
            "torch": _Builtin(".transports.torch_dist:TorchTransport", can_push=False)}


def transport_names() -> list[str]:
    """Every transport's name; imports no transport module."""
    return sorted(_BUILTIN)


def push_transport_names() -> list[str]:
    """Names of transports that can push, without importing any (the engine host
    decides ``kv_push`` in a process that must not load torch for it)."""
    return sorted(name for name, builtin in _BUILTIN.items() if builtin.can_push)


def create_transport(name: str, options: TransportOptions | None = None) -> KVTransport:
    """Build a transport by name, importing its module only now; an unknown name
    lists the valid ones."""
    builtin = _BUILTIN.get(name)
    if builtin is None:
        raise ValueError(
            f"unknown KV transport {name!r}; valid transports: {', '.join(transport_names())}"
        )
    module, _, cls = builtin.target.partition(":")
    factory: Callable[[TransportOptions], KVTransport] = getattr(
        importlib.import_module(module, __package__), cls)
    return factory(options or TransportOptions())
