"""Seeded inputs for a KV control port (``kv_transfer/control/server.py``).

Each input is what one fresh connection sends: an optional preamble the client
completes properly (``auth`` with the cluster secret, then a ``hello`` the server
accepts), then the fuzzed bytes, then an ending: a half-close (the server answers
what it read, then sees EOF), an abrupt close, or a stall (nothing more: the server
must drop the connection by its deadline). The classes are ``CLASSES``; ``make``
draws one input of a class from a ``random.Random``, so a seed replays a run.
"""

from __future__ import annotations

import dataclasses
import json
import random
import zlib
from dataclasses import dataclass
from typing import Any

from pdserve.bench.fuzz import kv_mutate
from pdserve.bench.fuzz.kv_mutate import frame, frame_raw

# Inputs per class, relative; "slow" and "stall" are capped by the driver as well.
CLASSES: dict[str, int] = {
    "random": 12, "truncated": 18, "malformed": 30, "before_hello": 8, "unknown_pull": 6,
    "push_range": 14, "auth": 0, "slow": 1, "stall": 1,
}
# On a port with a cluster secret, a share of the inputs attack the challenge itself.
SECRET_CLASSES: dict[str, int] = dict(CLASSES, auth=20)
GATED_OPS = ("pull", "pool_pull", "push", "push_abort")
_MAX_SENT_PAYLOAD = 64 << 10  # a push claiming more gets this much, then the ending


@dataclass(frozen=True)
class KvSurface:
    """What inputs may name on the target port: the ``compat`` its hello accepts,
    its KV blocks and layers, one block of one layer in bytes (a push's unit),
    requests holding a lease now and requests whose lease ended (refused at once),
    the block hashes its pool serves (hex), and whether it wants the cluster secret."""

    compat: dict[str, Any]
    num_blocks: int
    num_layers: int
    block_bytes: int
    live_ids: tuple[str, ...] = ()
    ended_ids: tuple[str, ...] = ()
    pool_hashes: tuple[str, ...] = ()
    secret: bool = False


@dataclass(frozen=True)
class KvInput:
    """One connection's worth: ``cls`` (a ``CLASSES`` key), ``auth`` and ``hello`` (the
    preamble the client completes first), ``data`` (sent after it), ``end`` ("eof":
    half-close, "close": close at once, "stall": hold the connection, send nothing),
    ``xfer`` (a push's transfer id) and ``may_stage`` (the server may keep staged blocks
    for it: a well-formed push, until the decode takes or drops it)."""

    cls: str
    data: bytes
    auth: bool = False
    hello: bool = False
    end: str = "eof"
    xfer: str | None = None
    may_stage: bool = False
    unknown_request: bool = False  # a pull or release of a request never leased here

    @property
    def slow(self) -> bool:
        """The server may hold it for a while: a stall, or a pull or release that names
        a request this port never leased (it waits for the lease first)."""
        return self.cls in ("slow", "stall") or self.unknown_request


def make(rng: random.Random, cls: str, surface: KvSurface, serial: int) -> KvInput:
    """An input of class ``cls``; ``serial`` makes its ids unique within a run."""
    auth = surface.secret and cls != "auth"
    item = _MAKERS[cls](rng, surface, serial, auth)
    if cls == "malformed" and _names_unknown_request(item.data, surface):
        item = dataclasses.replace(item, unknown_request=True)
    return item


# ---- valid messages: what the mutations start from ------------------------------------

def valid_message(rng: random.Random, op: str, surface: KvSurface, serial: int) -> dict[str, Any]:
    if op == "hello":
        return {"op": "hello", "compat": surface.compat}
    if op == "status":
        return {"op": "status"}
    if op == "release":
        return {"op": "release", "req": _known_id(rng, surface)}
    if op == "pull":
        return {"op": "pull", "req": _known_id(rng, surface), "runs": _runs(rng, surface),
                "checksum": rng.random() < 0.3}
    if op == "pool_pull":
        hashes = list(surface.pool_hashes) or [rng.randbytes(32).hex()]
        return {"op": "pool_pull", "hashes": rng.sample(hashes, rng.randint(1, len(hashes)))}
    if op == "push_abort":
        return {"op": "push_abort", "xfer": f"fz-abort-{serial}", "why": "fuzz"}
    return push_header(rng, surface, f"fz-push-{serial}")


def push_header(rng: random.Random, surface: KvSurface, xfer: str) -> dict[str, Any]:
    num_blocks = rng.randint(1, surface.num_blocks)
    first = rng.randrange(num_blocks)
    count = rng.randint(1, num_blocks - first)
    return {"op": "push", "xfer": xfer, "layer": rng.randrange(surface.num_layers),
            "first": first, "count": count, "num_blocks": num_blocks,
            "final": rng.random() < 0.7, "nbytes": count * surface.block_bytes}


def _known_id(rng: random.Random, surface: KvSurface) -> str:
    ids = surface.live_ids + surface.ended_ids
    return rng.choice(ids) if ids else f"fz-none-{rng.randrange(1 << 30)}"


def _runs(rng: random.Random, surface: KvSurface) -> list[list[int]]:
    first = rng.randrange(surface.num_blocks)
    runs = [[first, rng.randint(1, min(4, surface.num_blocks - first))]]
    if rng.random() < 0.3 and first > 0:
        runs.append([0, 1])
    return runs


def _xfer_sent(data: bytes) -> str | None:
    """The transfer id a framed push header carries, if it is one the server reads."""
    xfer = _sent(data).get("xfer")
    return xfer if isinstance(xfer, str) else None


def _names_unknown_request(data: bytes, surface: KvSurface) -> bool:
    """A mutated pull or release may name a request the port never leased (an empty
    string, say): the server then waits for its lease before refusing."""
    msg = _sent(data)
    req = msg.get("req")
    return (msg.get("op") in ("pull", "release") and isinstance(req, str)
            and req not in surface.live_ids + surface.ended_ids)


def _sent(data: bytes) -> dict[str, Any]:
    """The message of a frame as the server would read it ({} where it would not)."""
    try:
        msg = json.loads(data[4:])
    except (ValueError, RecursionError):
        return {}
    return msg if isinstance(msg, dict) else {}


def _payload(rng: random.Random, nbytes: int) -> bytes:
    return rng.randbytes(min(max(nbytes, 0), _MAX_SENT_PAYLOAD))


# ---- the classes ----------------------------------------------------------------------

def _random(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    size = rng.choice((1, 3, 4, 5, 17, 200, 4096))
    data = rng.randbytes(size)
    if rng.random() < 0.4:  # a plausible length, random body
        data = frame_raw(rng.randbytes(size))
    return KvInput("random", data, auth=auth, hello=rng.random() < 0.5,
                   end=rng.choice(("eof", "eof", "close")))


def _truncated(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    op = rng.choice(("hello", "status", "release", *GATED_OPS))
    msg = valid_message(rng, op, surface, serial)
    data = frame(msg)
    if op == "push":
        data += _payload(rng, msg["nbytes"])
    head = len(frame(msg))
    cut = rng.choice(("length", "header", "body", "last", *(("payload",) * (op == "push"))))
    at = {"length": rng.randint(1, 3), "header": 4, "last": len(data) - 1,
          "body": rng.randint(5, max(5, head - 1)),
          "payload": rng.randint(head, max(head, len(data) - 1))}[cut]
    return KvInput("truncated", data[:at], auth=auth, hello=op != "hello",
                   end=rng.choice(("eof", "eof", "close")), xfer=msg.get("xfer") if op == "push"
                   else None, may_stage=op == "push")


def _malformed(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    op = rng.choice(("hello", "status", "release", "pull", "pull", "pool_pull", "push",
                     "push", "push_abort"))
    msg = valid_message(rng, op, surface, serial)
    data = kv_mutate.mutate(rng, msg)
    xfer = _xfer_sent(data) if op == "push" else None  # the mutation may have renamed it
    if op == "push":
        data += _payload(rng, msg["nbytes"])
    return KvInput("malformed", data, auth=auth, hello=op != "hello", xfer=xfer,
                   may_stage=xfer is not None)


def _before_hello(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    op = rng.choice(GATED_OPS)
    msg = valid_message(rng, op, surface, serial)
    data = frame(msg) + (_payload(rng, msg["nbytes"]) if op == "push" else b"")
    return KvInput("before_hello", data, auth=auth)


def _unknown_pull(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    """Pulls and releases of requests whose lease ended (refused at once)."""
    ids = surface.ended_ids or (f"fz-none-{serial}",)
    msg: dict[str, Any] = {"op": rng.choice(("pull", "pull", "release")), "req": rng.choice(ids)}
    if msg["op"] == "pull":
        msg["runs"] = _runs(rng, surface)
    return KvInput("unknown_pull", frame(msg), auth=auth, hello=True)


def _slow(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    """A pull or release of a request this worker never leased: the server waits its
    lease wait (the scheduler may announce the lease late), then refuses."""
    msg: dict[str, Any] = {"op": rng.choice(("pull", "release")), "req": f"fz-never-{serial}"}
    if msg["op"] == "pull":
        msg["runs"] = _runs(rng, surface)
    return KvInput("slow", frame(msg), auth=auth, hello=True)


def _push_range(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    xfer = f"fz-push-{serial}"
    msg = push_header(rng, surface, xfer)
    payload = rng.randbytes(msg["nbytes"]) if msg["nbytes"] <= _MAX_SENT_PAYLOAD else b""
    staged = True  # well-formed: the inbox may keep it (the decode takes or drops it)
    roll = rng.random()
    if roll < 0.2 and payload:
        msg["crc32"] = zlib.crc32(payload) if rng.random() < 0.5 else rng.randrange(1 << 32)
    elif roll < 0.85:
        key, value = kv_mutate.push_out_of_range(rng, msg, surface.num_layers)
        msg[key] = value
        staged = False
        payload = _payload(rng, msg["nbytes"]) if isinstance(msg["nbytes"], int) else b""
    return KvInput("push_range", frame(msg) + payload, auth=auth, hello=True, xfer=xfer,
                   may_stage=staged)


def _auth(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    """Garbage where the cluster-secret challenge is expected (sent without waiting for
    the server's nonce: the server reads the proof after answering the first message)."""
    return KvInput("auth", kv_mutate.auth_garbage(rng), end=rng.choice(("eof", "eof", "close")))


def stall(rng: random.Random, surface: KvSurface, serial: int, auth: bool) -> KvInput:
    """A connection that stops sending at some point of a message and holds on."""
    msg = push_header(rng, surface, f"fz-stall-{serial}")
    pushed = frame(msg) + rng.randbytes(msg["nbytes"])
    pull = frame(valid_message(rng, "pull", surface, serial))
    where = rng.choice(("nothing", "length", "body", "payload", "between"))
    data = {"nothing": b"", "length": pull[:2], "body": pull[:len(pull) // 2],
            "payload": pushed[:len(frame(msg)) + max(1, msg["nbytes"] // 2)],
            "between": b""}[where]
    if surface.secret and rng.random() < 0.5:  # stalled before or inside the challenge
        auth, where = False, "challenge"
        data = frame({"op": "auth", "v": 1})[:rng.choice((0, 2, 6, 1000))]
    return KvInput("stall", data, auth=auth, hello=where in ("payload", "between"), end="stall",
                   xfer=msg["xfer"], may_stage=where == "payload")


_MAKERS = {"random": _random, "truncated": _truncated, "malformed": _malformed,
           "before_hello": _before_hello, "unknown_pull": _unknown_pull, "slow": _slow,
           "push_range": _push_range, "auth": _auth, "stall": stall}
