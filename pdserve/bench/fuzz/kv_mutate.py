"""Mutations of valid control messages: a field dropped or of another type, numbers
negative, huge or not finite, unknown ops, bodies that are not a JSON object, not
JSON, not UTF-8 or nested past any parser's depth, and length headers that lie.
Each returns the framed bytes (``frame``: what the wire carries)."""

from __future__ import annotations

import json
import random
import struct
from typing import Any

from pdserve.kv_transfer.control.wire import MAX_MESSAGE_BYTES

# Values of every JSON type, and numbers at the edges of every integer width.
ODD_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, -0.0, 2**31, 2**32, 2**63, -(2**63) - 1, 10**30, "",
    "x" * 600, "\u2603", "0", "-1", [], [[]], [1, 2, 3], {}, {"op": "pull"}, [[0, -1]],
    [[0, 10**12]], [[-1, 2]], [[0.5, 1]], [["0", "1"]], [[True, 1]],
)
# Number literals Python's json reads (as inf/nan, or an int past its digit limit).
RAW_NUMBERS = (b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"1" * 5000,
               b"-" + b"9" * 400)
_RAW = "\u0000raw\u0000"


def mutate(rng: random.Random, msg: dict[str, Any]) -> bytes:
    """``msg`` made wrong in one way (or a frame that lies about its length)."""
    how = rng.choice(("drop", "retype", "retype", "raw_number", "unknown_op", "extra",
                      "not_object", "deep", "bad_utf8", "not_json", "empty", "length"))
    body = dict(msg)
    raw: bytes | None = None
    keys = [k for k in body if k != "op"] or ["op"]
    if how == "drop":
        del body[rng.choice(keys)]
    elif how == "retype":
        body[rng.choice(keys)] = rng.choice(ODD_VALUES)
    elif how == "raw_number":
        body[rng.choice(keys)] = _RAW
        raw = rng.choice(RAW_NUMBERS)
    elif how == "unknown_op":
        body["op"] = rng.choice(("", "HELLO", "pull ", "auth", "auth_proof", "x" * 300,
                                 rng.randbytes(8).hex(), *ODD_VALUES[:12]))
    elif how == "extra":
        body[rng.choice(("op2", "runs2", "", "\u2603"))] = rng.choice(ODD_VALUES)
    else:
        return _unframed(rng, how, msg)
    text = json.dumps(body, separators=(",", ":")).encode()
    if raw is not None:
        text = text.replace(json.dumps(_RAW).encode(), raw)
    return frame_raw(text)


def _unframed(rng: random.Random, how: str, msg: dict[str, Any]) -> bytes:
    if how == "not_object":
        text = json.dumps(rng.choice(([msg], "pull", 7, None, [1, 2], True))).encode()
    elif how == "deep":
        depth = rng.choice((100, 990, 1100, 100_000))
        opener, closer = rng.choice(((b"[", b"]"), (b'{"a":', b"}")))
        text = opener * depth + b"1" + closer * depth
    elif how == "bad_utf8":
        text = b'{"op":"' + rng.choice((b"\xff\xfe", b"\xc3", b"\xed\xa0\x80")) + b'"}'
    elif how == "not_json":
        text = rng.choice((b"{", b"}", b"{'op': 'status'}", b"op=status", b"\x00" * 8,
                           b'{"op":"status"', b'{"op":"status"}}'))
    elif how == "empty":
        text = b""
    else:  # the length header lies: past the limit, or longer than what follows
        text = json.dumps(msg).encode()
        length = rng.choice((MAX_MESSAGE_BYTES + 1, 2**32 - 1, len(text) + 1000))
        return frame_raw(text, length)
    return frame_raw(text)


def push_out_of_range(rng: random.Random, msg: dict[str, Any], num_layers: int
                      ) -> tuple[str, Any]:
    """One push header field set out of range (or to a size the layout does not give)."""
    key = rng.choice(("layer", "first", "count", "num_blocks", "nbytes", "nbytes", "xfer",
                      "final", "crc32"))
    values: dict[str, tuple[Any, ...]] = {
        "layer": (num_layers, -1, 10**9, 2**40 + 1, 1.0),
        "first": (msg["num_blocks"], -1, 10**12),
        "count": (0, -1, msg["num_blocks"] - msg["first"] + 1, 10**12),
        "num_blocks": (0, -5, msg["first"], 10**12, 2**63),
        "nbytes": (msg["nbytes"] + 1, msg["nbytes"] - 1, 0, -1, 2**40 + 1, 10**15),
        "xfer": ("x" * 1000, 7, None, ["a"]),
        "final": ("yes", 1, None),
        "crc32": (-1, 2**32, "abc", 1.5),
    }
    return key, rng.choice(values[key])


def auth_garbage(rng: random.Random) -> bytes:
    """Bytes where a connection to a port with a cluster secret must authenticate."""
    hello = frame({"op": "auth", "v": 1})
    proof = {"op": "auth_proof", "nonce": rng.randbytes(16).hex(),
             "mac": rng.randbytes(32).hex()}
    roll = rng.randrange(7)
    if roll == 0:  # the right first message, a proof with a wrong MAC
        return hello + frame(proof)
    if roll == 1:  # a proof of the wrong shape
        key = rng.choice(("nonce", "mac", "op"))
        proof[key] = rng.choice(ODD_VALUES + ("00" * 16, "zz" * 16))
        return hello + frame(proof)
    if roll == 2:  # something else first: an op, a hello
        return frame({"op": rng.choice(("hello", "status", "pull", "push", "auth_proof"))})
    if roll == 3:  # over the challenge's message limit
        return frame({"op": "auth", "pad": "x" * rng.choice((1100, 70_000))})
    if roll == 4:
        return mutate(rng, {"op": "auth", "v": 1})
    if roll == 5:
        return hello + mutate(rng, proof)
    return rng.randbytes(rng.choice((1, 4, 30, 2000)))


def frame(msg: Any) -> bytes:
    """One control message as the wire carries it: 4-byte big-endian length, JSON."""
    return frame_raw(json.dumps(msg, separators=(",", ":")).encode())


def frame_raw(body: bytes, length: int | None = None) -> bytes:
    return struct.pack("!I", len(body) if length is None else length) + body
