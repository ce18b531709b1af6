"""Liveness after a fuzz: a second transport pulls leased blocks from the fuzzed one and
pushes blocks into its inbox, and the bytes that arrive are compared with the source."""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from pdserve.bench.fuzz.kv_client import Peer
from pdserve.kv_transfer.base import PeerAddress, TransportOptions, create_transport
from pdserve.kv_transfer.control.wire import TransferError
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.leases import LeaseTable
from pdserve.kv_transfer.push.inbox import PushInbox

SRC, DST = [3, 4, 5], [7, 8, 9]  # blocks pulled from the target, and where they land
PUSHED = [1, 2]  # the client's blocks pushed into the target's inbox


def pull_and_push(peer: Peer, options: TransportOptions, layout: KVLayout,
                  kv: Sequence[torch.Tensor], leases: LeaseTable, inbox: PushInbox,
                  timeout_s: float) -> str:
    """"pull+push ok", or what failed. ``kv``, ``leases`` and ``inbox`` are the fuzzed
    transport's; the client has the same layout, other bytes and the same secret."""
    client_kv = [torch.randn(t.shape, generator=torch.Generator().manual_seed(7 + i))
                 for i, t in enumerate(kv)]
    client = create_transport("tcp", options)
    client.start(kv_caches=client_kv, layout=layout, leases=LeaseTable(),
                 compat={k: v for k, v in peer.compat.items()
                         if k not in ("protocol_version", "transport")},
                 host="127.0.0.1", port=0)
    address = PeerAddress(peer.host, peer.port)
    try:
        req = f"liveness-{time.monotonic_ns()}"
        leases.add(req, SRC, time.time() + 60)
        client.pull(address, req, SRC, DST, time.monotonic() + timeout_s)
        if not all(torch.equal(c[DST], t[SRC]) for c, t in zip(client_kv, kv, strict=True)):
            return "FAILED: pulled bytes differ"
        channel = client.push_channel()
        if channel is None:
            return "pull ok (no push channel)"
        xfer = f"liveness-push-{time.monotonic_ns()}"
        for layer in range(len(kv)):
            channel.push(address, xfer, layer, 0, PUSHED, len(PUSHED), True,
                         time.monotonic() + timeout_s, checksum=True)
        landed = [torch.zeros_like(t) for t in kv]
        inbox.load(xfer, landed, 0, PUSHED, time.monotonic() + timeout_s)
        if not all(torch.equal(d[PUSHED], c[PUSHED]) for d, c in zip(landed, client_kv,
                                                                       strict=True)):
            return "FAILED: pushed bytes differ"
    except TransferError as exc:
        return f"FAILED: {exc}"
    finally:
        client.close()
    return "pull+push ok"
