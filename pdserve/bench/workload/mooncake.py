"""Mooncake-format request traces as ``pdserve bench run`` replays them
(``--workload mooncake-trace``): the FAST'25 traces of ``kvcache-ai/Mooncake``
(``FAST25-release/traces``), one JSON object per line with ``timestamp`` (ms from the
trace's start), ``input_length`` and ``output_length`` (tokens) and ``hash_ids`` (the
prompt's blocks of ``TRACE_BLOCK_TOKENS`` tokens; equal ids, equal blocks, and an id
names its whole prefix, so two prompts that share leading ids share those tokens).

``infinite_cache`` is what a cache that never evicts would serve of a run of records:
a request hits the longest run of its leading blocks that earlier requests referenced
(prefix semantics, as ``pdserve bench cache-sim`` replays them)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_BLOCK_TOKENS = 512  # tokens of one hash_id in the Mooncake traces


@dataclass(frozen=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True)
class TraceScale:
    """How a trace is shrunk for replay: ``block_tokens`` tokens per hash_id instead of
    512 (prompt and output lengths scale by the same factor), arrival times multiplied by
    ``time_scale``, outputs capped at ``max_output_tokens`` when set."""

    block_tokens: int = TRACE_BLOCK_TOKENS
    time_scale: float = 1.0
    max_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.block_tokens <= TRACE_BLOCK_TOKENS:
            raise ValueError(f"--trace-block-tokens must be in [1, {TRACE_BLOCK_TOKENS}], "
                             f"not {self.block_tokens}")
        if not (self.time_scale >= 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"--trace-time-scale must be >= 0 and finite, "
                             f"not {self.time_scale}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError("--output-len must be >= 1")

    @property
    def length_factor(self) -> float:
        return self.block_tokens / TRACE_BLOCK_TOKENS

    def input_tokens(self, record: TraceRecord) -> int:
        """The scaled prompt length: its blocks all full but the last, which holds at
        least one token (the trace's length, scaled, within what its blocks allow)."""
        num_blocks, b = len(record.hash_ids), self.block_tokens
        scaled = math.ceil(record.input_length * self.length_factor)
        return min(max(scaled, (num_blocks - 1) * b + 1), num_blocks * b)

    def output_tokens(self, record: TraceRecord) -> int:
        scaled = max(1, round(record.output_length * self.length_factor))
        return min(scaled, self.max_output_tokens or scaled)

    def arrival_s(self, record: TraceRecord, first: TraceRecord) -> float:
        """Seconds after the run's start: the trace's offset from ``first``, scaled."""
        return (record.timestamp_ms - first.timestamp_ms) / 1000 * self.time_scale


def _int(record: dict[str, Any], key: str, least: int) -> int:
    value = record[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f'"{key}" must be an integer >= {least}, not {value!r}')
    return value


def _record(record: Any) -> TraceRecord:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    ids = record["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError('"hash_ids" must be a non-empty list of block ids')
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError('"hash_ids" must hold integers >= 0')
    stamp = record["timestamp"]
    if isinstance(stamp, bool) or not isinstance(stamp, int | float) or stamp < 0:
        raise ValueError(f'"timestamp" must be a number of ms >= 0, not {stamp!r}')
    rec = TraceRecord(float(stamp), _int(record, "input_length", 1),
                      _int(record, "output_length", 0), tuple(ids))
    if rec.input_length > len(ids) * TRACE_BLOCK_TOKENS:
        raise ValueError(f"input_length {rec.input_length} exceeds its {len(ids)} blocks "
                         f"of {TRACE_BLOCK_TOKENS} tokens")
    return rec


def load_trace(path: str | Path, start: int = 0, limit: int | None = None
               ) -> list[TraceRecord]:
    """Records ``start`` to ``start + limit`` of the trace at ``path`` (all after
    ``start`` without ``limit``); ``ValueError`` naming the file and line of a bad one."""
    if start < 0 or (limit is not None and limit < 1):
        raise ValueError("--trace-start must be >= 0 and --num-requests >= 1")
    path = Path(path)
    records: list[TraceRecord] = []
    try:
        with path.open(encoding="utf-8") as f:
            lines = [(n, line) for n, line in enumerate(f, 1) if line.strip()]
    except OSError as exc:
        raise ValueError(f"trace {path}: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise ValueError(f"trace {path}: not UTF-8 text") from None
    end = len(lines) if limit is None else start + limit
    for num, line in lines[start:end]:
        try:
            records.append(_record(json.loads(line)))
        except json.JSONDecodeError as exc:
            raise ValueError(f"trace {path}:{num}: not JSON ({exc.msg})") from None
        except KeyError as exc:
            raise ValueError(f"trace {path}:{num}: no {exc} (a Mooncake record has "
                             "timestamp, input_length, output_length, hash_ids)") from None
        except ValueError as exc:
            raise ValueError(f"trace {path}:{num}: {exc}") from None
    if not records:
        raise ValueError(f"trace {path}: no records after --trace-start {start} "
                         f"(it has {len(lines)})")
    if any(b.timestamp_ms < a.timestamp_ms for a, b in zip(records, records[1:], strict=False)):
        raise ValueError(f"trace {path}: timestamps go backwards (a trace is in time order)")
    return records


@dataclass(frozen=True)
class CacheBound:
    """What an infinite cache serves of a run of records, at one scale."""

    num_hit_blocks: int
    num_blocks: int
    num_hit_tokens: int
    num_tokens: int

    @property
    def block_ratio(self) -> float:
        return self.num_hit_blocks / self.num_blocks if self.num_blocks else 0.0

    @property
    def token_ratio(self) -> float:
        return self.num_hit_tokens / self.num_tokens if self.num_tokens else 0.0


def infinite_cache(records: Sequence[TraceRecord], scale: TraceScale,
                   engine_block_tokens: int | None = None) -> CacheBound:
    """Each request hits its leading blocks that some earlier request referenced; tokens
    count each block's scaled size (the last block of a prompt is partial).
    ``engine_block_tokens``: what an engine that caches whole blocks of this many tokens
    and computes at least a prompt's last token (vLLM) could serve of those hit tokens."""
    seen: set[int] = set()
    hit_blocks = blocks = hit_tokens = tokens = 0
    for rec in records:
        num = 0
        while num < len(rec.hash_ids) and rec.hash_ids[num] in seen:
            num += 1
        length = scale.input_tokens(rec)
        hit_blocks, blocks = hit_blocks + num, blocks + len(rec.hash_ids)
        hit = min(num * scale.block_tokens, length)
        if engine_block_tokens is not None:
            hit = min(hit, length - 1) // engine_block_tokens * engine_block_tokens
        hit_tokens += hit
        tokens += length
        seen.update(rec.hash_ids)
    return CacheBound(hit_blocks, blocks, hit_tokens, tokens)
