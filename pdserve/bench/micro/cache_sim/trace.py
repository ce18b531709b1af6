"""A Mooncake-format trace (FAST'25, ``kvcache-ai/Mooncake``, ``FAST25-release/traces``):
one JSON object per line with ``timestamp`` (ms), ``input_length``, ``output_length``
and ``hash_ids`` (a request's prompt blocks, 512 tokens each, equal ids equal blocks)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Trace:
    name: str
    times_s: tuple[float, ...]  # each request's arrival, seconds from the trace's start
    blocks: tuple[tuple[bytes, ...], ...]  # each request's block keys, prompt order

    @property
    def num_block_refs(self) -> int:
        return sum(len(b) for b in self.blocks)

    @property
    def num_distinct_blocks(self) -> int:
        return len({k for b in self.blocks for k in b})


def block_key(hash_id: int) -> bytes:
    """A trace's block id as a tier key (the tiers name blocks by bytes)."""
    return hash_id.to_bytes(8, "little")


def load_trace(path: str | Path) -> Trace:
    """The trace at ``path``; ``ValueError`` naming the line of a malformed record."""
    keys: dict[int, bytes] = {}
    times, blocks = [], []
    with Path(path).open() as f:
        for num, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                ids = [int(i) for i in record["hash_ids"]]
                t = float(record.get("timestamp", 0)) / 1000
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{num}: not a Mooncake trace record ({exc})") from exc
            if any(i < 0 for i in ids):
                raise ValueError(f"{path}:{num}: negative hash id")
            times.append(t)
            blocks.append(tuple(keys.setdefault(i, block_key(i)) for i in ids))
    return Trace(Path(path).stem, tuple(times), tuple(blocks))
