"""A streamed OpenAI response's events, read from its ``data:`` lines: what the benches
that check streamed token ids (``micro/partitions.py``) and the tests read."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any


def sse_events(lines: Iterable[str]) -> Iterator[dict[str, Any]]:
    """The JSON events of a streamed response's ``data:`` lines (``[DONE]`` and anything
    else that is not an object skipped)."""
    for line in lines:
        if line.startswith("data: {"):
            yield json.loads(line.removeprefix("data: "))


def token_ids(event: dict[str, Any]) -> list[int]:
    """One streamed event's token ids, over its choices."""
    return [t for c in event["choices"] for t in c.get("token_ids") or []]
