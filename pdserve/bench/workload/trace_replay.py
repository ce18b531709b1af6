"""``mooncake-trace``: a Mooncake trace's requests (``mooncake.py``) with prompts made of
token ids, so the trace's prefix sharing is prefix sharing in tokens.

Each hash_id maps, through a seeded generator of its own, to one block of
``block_tokens`` token ids drawn from the tokenizer's non-special ids; a prompt is its
blocks' ids concatenated, the last block cut to the prompt's (scaled) length. Equal ids
give equal blocks whatever request they are in, different ids (almost surely) differ.
The prompt is sent as token ids on the completions endpoint, which neither re-tokenizes
nor adds special tokens to them: the engine sees exactly these blocks. Requests carry the
trace's arrival times (scaled by ``--trace-time-scale``, or to ``--request-rate``'s mean
rate), which the runner follows instead of its arrival process."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import fields
from typing import Any

from pdserve.bench.load.config import RunConfig
from pdserve.bench.workload.mooncake import (
    TraceRecord,
    TraceScale,
    infinite_cache,
    load_trace,
)
from pdserve.bench.workload.prompts import BenchRequest

ENGINE_BLOCKS = (16, 128)  # vLLM's default KV block size on GPUs and on CPUs


class BlockTokens:
    """hash_id -> its block of token ids: a pure function of ``seed`` and the id."""

    def __init__(self, vocab: Sequence[int], block_tokens: int, seed: int) -> None:
        if not vocab:
            raise ValueError("the tokenizer has no non-special token ids")
        self.vocab, self.block_tokens, self.seed = vocab, block_tokens, seed

    def block(self, hash_id: int) -> list[int]:
        return random.Random(f"{self.seed}:trace-block:{hash_id}").choices(
            self.vocab, k=self.block_tokens)

    def prompt(self, hash_ids: Sequence[int], num_tokens: int) -> tuple[int, ...]:
        """The blocks of ``hash_ids`` in order, cut to ``num_tokens``."""
        ids: list[int] = []
        for hash_id in hash_ids:
            if len(ids) >= num_tokens:
                break
            ids += self.block(hash_id)
        return tuple(ids[:num_tokens])


class TraceWorkload:
    """The trace's records in order, each a token-id prompt with its arrival time; ends
    with the records (not endless). ``num_yielded`` counts what was drawn, so the result
    reports the infinite-cache bound of exactly the requests drawn."""

    def __init__(self, records: Sequence[TraceRecord], scale: TraceScale,
                 vocab: Sequence[int], seed: int, path: str = "", start: int = 0) -> None:
        self.records, self.scale, self.path, self.start = records, scale, path, start
        self.blocks = BlockTokens(vocab, scale.block_tokens, seed)
        self.num_yielded = 0

    def request(self, index: int) -> BenchRequest:
        rec, scale = self.records[index], self.scale
        ids = self.blocks.prompt(rec.hash_ids, scale.input_tokens(rec))
        return BenchRequest([], len(ids), scale.output_tokens(rec), prompt_ids=ids,
                            arrival_s=scale.arrival_s(rec, self.records[0]))

    def __iter__(self) -> Iterator[BenchRequest]:
        for index in range(len(self.records)):
            self.num_yielded = max(self.num_yielded, index + 1)
            yield self.request(index)

    def info(self, max_model_len: int | None = None) -> dict[str, Any]:
        """The replay's scale and the infinite-cache bound of the requests drawn that fit
        ``max_model_len`` (the runner skips the others): over all their tokens, and as an
        engine caching whole blocks of 16 (vLLM on GPUs) or 128 tokens (on CPUs) could
        serve it; a run's ``cached_token_share`` compares with the latter."""
        drawn = self.records[:self.num_yielded]
        scale = self.scale
        sent = [r for r in drawn if max_model_len is None
                or scale.input_tokens(r) + scale.output_tokens(r) <= max_model_len]
        bound = infinite_cache(sent, scale)
        span_ms = drawn[-1].timestamp_ms - drawn[0].timestamp_ms if drawn else 0.0
        return {"trace": {
            "path": self.path, "start": self.start, "num_requests": len(drawn),
            "num_sendable": len(sent), "block_tokens": scale.block_tokens,
            "length_factor": scale.length_factor, "time_scale": scale.time_scale,
            "max_output_tokens": scale.max_output_tokens,
            "trace_span_s": span_ms / 1000, "replay_span_s": span_ms / 1000 * scale.time_scale,
            "infinite_cache_block_ratio": bound.block_ratio,
            "infinite_cache_token_ratio": bound.token_ratio,
            "infinite_cache_token_ratio_engine_block": {
                str(e): infinite_cache(sent, scale, e).token_ratio for e in ENGINE_BLOCKS},
            "prompt_tokens": bound.num_tokens,
        }}


def check_trace_flags(cfg: RunConfig) -> tuple[TraceRecord, ...] | None:
    """``mooncake-trace``'s flags, and its records (``--dataset`` from ``--trace-start``,
    at most ``--num-requests`` of them); the trace flags refused on other workloads."""
    if cfg.workload != "mooncake-trace":
        for field in fields(RunConfig):
            if field.name.startswith("trace_") and getattr(cfg, field.name) != field.default:
                flag = "--" + field.name.replace("_", "-")
                raise ValueError(f"{flag} needs --workload mooncake-trace")
        return None
    if not cfg.dataset:
        raise ValueError("--workload mooncake-trace needs --dataset FILE (a Mooncake "
                         "trace, JSONL)")
    if cfg.endpoint != "completions":
        raise ValueError("--workload mooncake-trace sends token-id prompts: it needs "
                         "--endpoint completions")
    TraceScale(cfg.trace_block_tokens, cfg.trace_time_scale, cfg.output_len)
    records = tuple(load_trace(cfg.dataset, cfg.trace_start, cfg.num_requests))
    _scale(cfg, records)
    return records


def _scale(cfg: RunConfig, records: Sequence[TraceRecord]) -> TraceScale:
    """The flags' scale; a finite ``--request-rate`` R sets the time scale so that the
    ``n`` records span ``n / R`` seconds (as ``arrivals.py`` spans ``n`` arrivals)."""
    time_scale = cfg.trace_time_scale
    if not math.isinf(cfg.request_rate):
        if time_scale != 1.0:
            raise ValueError("--workload mooncake-trace: give --request-rate (the trace's "
                             "times scaled to that mean rate) or --trace-time-scale, "
                             "not both")
        span_s = (records[-1].timestamp_ms - records[0].timestamp_ms) / 1000
        if span_s <= 0:
            raise ValueError("--request-rate: the requests replayed all arrive at one "
                             "time in the trace; no rate can space them")
        time_scale = len(records) / (cfg.request_rate * span_s)
    return TraceScale(cfg.trace_block_tokens, time_scale, cfg.output_len)


def trace_workload(cfg: RunConfig, vocab: Sequence[int], seed: int,
                   records: tuple[TraceRecord, ...] | None) -> TraceWorkload:
    """``mooncake-trace``'s workload (``records``: ``check_trace_flags``')."""
    records = records if records is not None else check_trace_flags(cfg)
    if records is None:
        raise ValueError("not a mooncake-trace run")
    return TraceWorkload(records, _scale(cfg, records), vocab, seed, cfg.dataset or "",
                         cfg.trace_start)
