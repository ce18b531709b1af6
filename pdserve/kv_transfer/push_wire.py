"""Layer-wise push on a KV connection: the ``push`` and ``push_abort`` ops.

``push``: a JSON header (transfer id, layer, first position, count, the
prompt's block count, payload size, optional CRC32), then the raw bytes of
``count`` blocks of one layer (per outer chunk, in position order), then one
reply. A refused push (inbox full, bad shape) is drained and answered with an
error, so the connection stays usable; the prefill stops pushing that transfer
and the decode pulls instead.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.kv_transfer.integrity import checksum
from pdserve.kv_transfer.layout import LayerLayout, as_bytes, paired_runs
from pdserve.kv_transfer.push_inbox import PushInbox
from pdserve.kv_transfer.wire import TransferError, check_reply, recv_into_exact, recv_msg, send_msg

_DRAIN = 1 << 20


def layer_chunks(
    tensor: torch.Tensor, lay: LayerLayout, block_ids: Sequence[int]
) -> list[torch.Tensor]:
    """One layer's blocks in wire order: per outer chunk, runs of consecutive ids."""
    runs = paired_runs(block_ids, block_ids)
    outer = tensor.reshape(lay.num_outer, *tensor.shape[lay.block_dim:])
    return [outer[o, s:s + n] for o in range(lay.num_outer) for s, _, n in runs]


def send_push(
    conn: socket.socket, header: dict[str, Any], chunks: Sequence[torch.Tensor], verify: bool
) -> int:
    """Send one push and wait for its reply; returns payload bytes. The payload
    always travels through host memory, so ``verify`` is a CRC-32 of those bytes."""
    host = [c if c.device.type == "cpu" else c.to("cpu") for c in chunks]
    views = [as_bytes(c) for c in host]
    crc = checksum(host, "crc32") if verify else None
    nbytes = sum(len(v) for v in views)
    send_msg(conn, dict(header, op="push", nbytes=nbytes, crc32=crc))
    for view in views:
        conn.sendall(view)
    check_reply(recv_msg(conn), f"push of {header.get('xfer')}")
    return nbytes


def serve_push(conn: socket.socket, msg: dict[str, Any], inbox: PushInbox | None) -> int:
    """Receive one push into ``inbox``; returns bytes stored (0 if refused)."""
    nbytes = int(msg["nbytes"])
    xfer = str(msg["xfer"])
    layer, first, count = int(msg["layer"]), int(msg["first"]), int(msg["count"])
    try:
        if inbox is None:
            raise TransferError("this worker does not accept pushed KV")
        views = inbox.receive_views(xfer, layer, first, count, int(msg["num_blocks"]))
        if sum(len(v) for v in views) != nbytes:
            raise TransferError(f"push payload of {nbytes} bytes does not match the layout")
    except TransferError as exc:
        _drain(conn, nbytes)
        send_msg(conn, {"ok": False, "error": str(exc)})
        return 0
    for view in views:
        recv_into_exact(conn, view)
    crc = msg.get("crc32")
    try:
        inbox.commit(xfer, layer, first, count, bool(msg.get("final", True)),
                     None if crc is None else int(crc))
    except TransferError as exc:
        send_msg(conn, {"ok": False, "error": str(exc)})
        return 0
    send_msg(conn, {"ok": True})
    return nbytes


def serve_push_abort(conn: socket.socket, msg: dict[str, Any], inbox: PushInbox | None) -> None:
    if inbox is not None:
        inbox.fail(str(msg["xfer"]), str(msg.get("why", "aborted by the prefill")))
    send_msg(conn, {"ok": True})


def _drain(conn: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(min(nbytes, _DRAIN) or 1))
    while nbytes > 0:
        n = min(nbytes, len(buf))
        recv_into_exact(conn, buf[:n])
        nbytes -= n
