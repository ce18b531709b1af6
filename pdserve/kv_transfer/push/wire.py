"""Layer-wise push on a KV connection: the ``push`` and ``push_abort`` ops.

``push``: a JSON header (transfer id, layer, first position, count, the
prompt's block count, payload size, optional CRC32), then the raw bytes of
``count`` blocks of one layer (per outer chunk, in position order), then one
reply. A push the inbox refuses (full, a failed transfer) is drained and
answered with an error, so the connection stays usable; the prefill stops pushing
that transfer and the decode pulls instead. A header that cannot frame its payload
(a bad field, a size the layout does not give) is answered and the connection
closed, before anything is staged.
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.kv_transfer.control import fields
from pdserve.kv_transfer.control.wire import (
    BadMessageError,
    TransferError,
    check_reply,
    recv_into_exact,
    recv_msg,
    send_msg,
)
from pdserve.kv_transfer.integrity import checksum
from pdserve.kv_transfer.layout import LayerLayout, as_bytes, paired_runs
from pdserve.kv_transfer.push.inbox import PushInbox

_DRAIN = 1 << 20
# No push is larger (a header saying more is refused before its payload is read).
_MAX_PAYLOAD = 1 << 40


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
    """Receive one push into ``inbox``; returns bytes stored (0 if refused).

    A header that cannot be trusted to frame its payload (a field missing or out of
    range, a size the layout does not give; a refused payload larger than the inbox)
    raises ``BadMessageError`` before anything is staged: the server answers it and
    closes the connection. A well-formed push the inbox refuses (full, a failed
    transfer) is drained and answered; the connection stays usable."""
    nbytes = fields.integer(msg, "nbytes", 0, _MAX_PAYLOAD)
    xfer = fields.text(msg, "xfer")
    layer = fields.integer(msg, "layer", 0, _MAX_PAYLOAD)
    num_blocks = fields.integer(msg, "num_blocks", 1, _MAX_PAYLOAD)
    first = fields.integer(msg, "first", 0, num_blocks - 1)
    count = fields.integer(msg, "count", 1, num_blocks - first)
    final = fields.flag(msg, "final", True)
    crc = fields.optional_integer(msg, "crc32", 0, 0xFFFFFFFF)
    if inbox is None:  # nothing says how large a payload may be here: not read
        raise BadMessageError("this worker does not accept pushed KV")
    if layer >= inbox.num_layers:
        raise BadMessageError(f"push of layer {layer}: this worker has {inbox.num_layers}")
    want = inbox.payload_bytes(layer, count)
    if nbytes != want:
        raise BadMessageError(f"push payload of {nbytes} bytes: {count} blocks of layer "
                              f"{layer} are {want} here")
    try:
        views = inbox.receive_views(xfer, layer, first, count, num_blocks)
    except TransferError as exc:
        if nbytes > inbox.capacity_bytes:  # more than the inbox could ever hold: not read
            raise BadMessageError(str(exc)) from None
        _drain(conn, nbytes)
        send_msg(conn, {"ok": False, "error": str(exc)})
        return 0
    for view in views:
        recv_into_exact(conn, view)
    try:
        inbox.commit(xfer, layer, first, count, final, crc)
    except TransferError as exc:
        send_msg(conn, {"ok": False, "error": str(exc)})
        return 0
    send_msg(conn, {"ok": True})
    return nbytes


def serve_push_abort(conn: socket.socket, msg: dict[str, Any], inbox: PushInbox | None) -> None:
    xfer = fields.text(msg, "xfer")
    why = fields.text(msg, "why", 4096) if "why" in msg else "aborted by the prefill"
    if inbox is not None:
        inbox.fail(xfer, why)
    send_msg(conn, {"ok": True})


def _drain(conn: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(min(nbytes, _DRAIN) or 1))
    while nbytes > 0:
        n = min(nbytes, len(buf))
        recv_into_exact(conn, buf[:n])
        nbytes -= n
