"""Typed reads of a control message's fields, for the serving side.

A peer's message is untrusted input: each handler reads its fields through these,
so a field missing, of the wrong type or out of range raises ``BadMessageError``
naming it (the server answers that and closes the connection), never a
``KeyError`` or ``TypeError`` from deep inside a handler. JSON booleans are not
integers here, and numbers are never coerced from strings or floats.
"""

from __future__ import annotations

from typing import Any

from pdserve.kv_transfer.control.wire import BadMessageError

# Request and transfer ids are short; anything longer is not one of ours.
MAX_ID_CHARS = 512


def text(msg: dict[str, Any], key: str, max_chars: int = MAX_ID_CHARS) -> str:
    """``msg[key]``, a string of at most ``max_chars`` characters."""
    value = _get(msg, key)
    if not isinstance(value, str) or len(value) > max_chars:
        raise BadMessageError(f"{_op(msg)}: {key!r} must be a string of at most {max_chars} "
                              f"characters, got {_kind(value)}")
    return value


def integer(msg: dict[str, Any], key: str, lo: int, hi: int) -> int:
    """``msg[key]``, an integer in ``[lo, hi]``."""
    value = _get(msg, key)
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise BadMessageError(f"{_op(msg)}: {key!r} must be an integer in [{lo}, {hi}], "
                              f"got {_kind(value)}")
    return value


def optional_integer(msg: dict[str, Any], key: str, lo: int, hi: int) -> int | None:
    """``msg[key]`` as ``integer`` reads it, or None where it is absent or null."""
    return None if msg.get(key) is None else integer(msg, key, lo, hi)


def flag(msg: dict[str, Any], key: str, default: bool) -> bool:
    """``msg[key]``, a boolean (``default`` where absent)."""
    value = msg.get(key, default)
    if not isinstance(value, bool):
        raise BadMessageError(f"{_op(msg)}: {key!r} must be true or false, got {_kind(value)}")
    return value


def obj(msg: dict[str, Any], key: str) -> dict[str, Any]:
    """``msg[key]``, a JSON object (``{}`` where absent)."""
    value = msg.get(key, {})
    if not isinstance(value, dict):
        raise BadMessageError(f"{_op(msg)}: {key!r} must be an object, got {_kind(value)}")
    return value


def block_runs(msg: dict[str, Any], key: str, num_blocks: int) -> list[tuple[int, int]]:
    """``msg[key]``: (first block, count) pairs inside ``[0, num_blocks)``, each of at
    least one block and at most ``num_blocks`` blocks in all (a pull names distinct
    blocks, so more is not one)."""
    value = _get(msg, key)
    if not isinstance(value, list) or not 0 < len(value) <= num_blocks:
        raise BadMessageError(f"{_op(msg)}: {key!r} must be a list of 1 to {num_blocks} "
                              f"[first, count] pairs, got {_kind(value)}")
    runs = []
    for pair in value:
        ok = isinstance(pair, list) and len(pair) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in pair)
        if not ok or not (0 <= pair[0] and 1 <= pair[1] and pair[0] + pair[1] <= num_blocks):
            raise BadMessageError(f"{_op(msg)}: {key!r} holds {_kind(pair)}, not a [first, "
                                  f"count] pair with count >= 1 inside {num_blocks} blocks")
        runs.append((pair[0], pair[1]))
    if sum(n for _, n in runs) > num_blocks:
        raise BadMessageError(f"{_op(msg)}: {key!r} names more than {num_blocks} blocks")
    return runs


def _get(msg: dict[str, Any], key: str) -> Any:
    if key not in msg:
        raise BadMessageError(f"{_op(msg)}: field {key!r} is missing")
    return msg[key]


def _op(msg: dict[str, Any]) -> str:
    op = msg.get("op")
    return f"{op[:32]!r} message" if isinstance(op, str) else "message"


def _kind(value: Any) -> str:
    """What was sent, briefly: its type, and the value itself when it is a short scalar
    (a container's repr could be megabytes, or nested too deep to print)."""
    name = type(value).__name__
    if isinstance(value, list | dict):
        return f"{name} of {len(value)}"
    try:
        shown = repr(value)
    except ValueError:  # an integer past Python's digit limit
        return name
    return f"{name} {shown}" if len(shown) <= 40 else name
