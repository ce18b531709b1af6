"""The workloads: endless, seeded sequences of requests (same seed, same requests).

- ``random``: one class of ``input_len`` x ``output_len`` tokens, each drawn uniformly
  within ``range_ratio`` of it (vLLM's random dataset).
- ``chat-mix``: classes in shares (``0.7:80:96,0.3:1200:16``: 70 % 80-token prompts with 96
  output tokens, 30 % 1,200 with 16), each request's class drawn by share.
- ``shared-prefix``: conversations (system prompt x user x turn). Turn ``t`` of a user
  sends its system prompt, its turns so far with stand-in assistant replies of
  ``output_len`` tokens (fixed text, so prompts do not depend on what the server
  answers) and the new turn; all users' turn 0 go first, then turn 1, and so on, so each
  turn's prefix was computed a round before: a cache-aware placement reuses it. After
  the last turn a new set of users starts. This is the multi-turn chat workload of the
  KV tiers' benchmark (docs/benchmarks.md, "Multi-turn reuse"): with more users than the
  engine's cache holds, a user's history is evicted before its next turn comes, and only
  a tier below the cache can serve it.
- ``no-reuse``: shared-prefix's control: request ``i`` has the shape of shared-prefix's
  request ``i`` (the same messages, roles, token counts and output length) but every
  message of every request is fresh random text, so no two prompts share more than the
  chat template's first few tokens and no cache can serve any of it (the tiers' overhead).
- ``sharegpt``: a ShareGPT file's prompts in a seeded order, repeated if needed.
- ``mooncake-trace``: a Mooncake trace's requests at its times, prompts of token ids
  built from its ``hash_ids`` (``trace_replay.py``).

Every prompt is built from random tokens to an exact count through the endpoint's
tokenizer and chat template (``PromptEncoder.fit``), so ``--input-len 500`` means the
server counts 500 prompt tokens (``mooncake-trace``'s are token ids, sent as they are).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from pdserve.bench.load.config import RunConfig
from pdserve.bench.workload.mooncake import TraceRecord
from pdserve.bench.workload.prompts import BenchRequest, Messages, PromptEncoder
from pdserve.bench.workload.sharegpt import ShareGptData, load_sharegpt
from pdserve.bench.workload.trace_replay import TraceWorkload, check_trace_flags, trace_workload

WORKLOADS = ("random", "chat-mix", "shared-prefix", "no-reuse", "sharegpt", "mooncake-trace")
DEFAULT_OUTPUT_LEN = 128  # synthetic workloads; sharegpt takes the reference completion's


@dataclass(frozen=True)
class LengthClass:
    share: float
    input_len: int
    output_len: int


def parse_mix(text: str) -> list[LengthClass]:
    """``"0.7:80:96,0.3:1200:16"`` -> classes (shares normalized to 1)."""
    classes = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            share, num_in, num_out = float(parts[0]), int(parts[1]), int(parts[2])
            if len(parts) != 3:
                raise ValueError
        except (ValueError, IndexError):
            raise ValueError(f"bad --mix item {item.strip()!r}: expected "
                             "SHARE:INPUT_TOKENS:OUTPUT_TOKENS, e.g. 0.7:80:96") from None
        if share <= 0 or num_in < 1 or num_out < 1:
            raise ValueError(f"bad --mix item {item.strip()!r}: share > 0, lengths >= 1")
        classes.append(LengthClass(share, num_in, num_out))
    total = sum(c.share for c in classes)
    return [replace(c, share=c.share / total) for c in classes]


def _around(n: int, ratio: float, rng: random.Random) -> int:
    return max(1, rng.randint(math.floor(n * (1 - ratio)), math.ceil(n * (1 + ratio))))


class MixWorkload:
    """``random`` (one class) and ``chat-mix``."""

    def __init__(self, encoder: PromptEncoder, classes: list[LengthClass],
                 range_ratio: float, seed: int, then: list[LengthClass] | None = None,
                 shift_at: int = 0) -> None:
        """``then``: from request ``shift_at`` on, draw from these classes instead."""
        if not 0 <= range_ratio < 1:
            raise ValueError(f"--range-ratio must be in [0, 1), not {range_ratio}")
        self.encoder, self.classes, self.range_ratio, self.seed = (
            encoder, classes, range_ratio, seed)
        self.then, self.shift_at = then, shift_at

    def request(self, index: int) -> BenchRequest:
        rng = random.Random(f"{self.seed}:{index}")
        classes = self.then if self.then and index >= self.shift_at else self.classes
        pick, cls = rng.random(), classes[-1]
        for c in classes:
            if pick < c.share:
                cls = c
                break
            pick -= c.share
        num_in = _around(cls.input_len, self.range_ratio, rng)
        num_out = _around(cls.output_len, self.range_ratio, rng)
        return replace(self.encoder.fit_user(num_in, rng), output_tokens=num_out)

    def __iter__(self) -> Iterator[BenchRequest]:
        return map(self.request, itertools.count())


@dataclass(frozen=True)
class SharedPrefixShape:
    num_system_prompts: int
    system_prompt_len: int
    num_users: int
    num_turns: int
    turn_input_len: int
    output_len: int

    def __post_init__(self) -> None:
        if min(self.num_system_prompts, self.system_prompt_len, self.num_users,
               self.num_turns, self.turn_input_len, self.output_len) < 1:
            raise ValueError("shared-prefix sizes must all be >= 1")


class SharedPrefixWorkload:
    def __init__(self, encoder: PromptEncoder, shape: SharedPrefixShape, seed: int) -> None:
        self.encoder, self.shape, self.seed = encoder, shape, seed
        rng = random.Random(f"{seed}:system")
        self.systems = [encoder.fit(shape.system_prompt_len, rng)[0]
                        for _ in range(shape.num_system_prompts)]

    def _round(self, round_index: int) -> Iterator[BenchRequest]:
        s, enc = self.shape, self.encoder
        chats: list[Messages] = []
        for u in range(s.num_users):
            rng = random.Random(f"{self.seed}:user:{round_index}:{u}")
            system = self.systems[(round_index * s.num_users + u) % s.num_system_prompts]
            chats.append([{"role": "system", "content": system}])
            for t in range(s.num_turns):
                chats[u].append({"role": "user", "content": enc.fit(s.turn_input_len, rng)[0]})
                if t < s.num_turns - 1:
                    reply = enc.fit(s.output_len, rng)[0]
                    chats[u].append({"role": "assistant", "content": reply})
        for t in range(s.num_turns):
            for chat in chats:
                messages = chat[:2 + 2 * t]
                yield BenchRequest(messages, enc.count(messages), s.output_len)

    def __iter__(self) -> Iterator[BenchRequest]:
        return itertools.chain.from_iterable(map(self._round, itertools.count()))


class NoReuseWorkload:
    """``no-reuse``: ``SharedPrefixWorkload``'s requests, in the same order and of the same
    shape, with every message fresh random text (no shared system prompt, no history)."""

    def __init__(self, encoder: PromptEncoder, shape: SharedPrefixShape, seed: int) -> None:
        self.encoder, self.shape, self.seed = encoder, shape, seed

    def request(self, index: int) -> BenchRequest:
        s, enc = self.shape, self.encoder
        turn = index % (s.num_users * s.num_turns) // s.num_users
        rng = random.Random(f"{self.seed}:no-reuse:{index}")
        messages = [{"role": "system", "content": enc.fit(s.system_prompt_len, rng)[0]}]
        for t in range(turn + 1):
            messages.append({"role": "user", "content": enc.fit(s.turn_input_len, rng)[0]})
            if t < turn:
                messages.append({"role": "assistant", "content": enc.fit(s.output_len, rng)[0]})
        return BenchRequest(messages, enc.count(messages), s.output_len)

    def __iter__(self) -> Iterator[BenchRequest]:
        return map(self.request, itertools.count())


class ShareGptWorkload:
    def __init__(self, encoder: PromptEncoder, data: ShareGptData, output_len: int | None,
                 seed: int) -> None:
        self.num_malformed = data.num_malformed
        self.pairs = list(data.pairs)
        random.Random(seed).shuffle(self.pairs)
        self.encoder, self.output_len = encoder, output_len

    def __iter__(self) -> Iterator[BenchRequest]:
        for prompt, completion in itertools.cycle(self.pairs):
            messages = [{"role": "user", "content": prompt}]
            num_out = self.output_len or max(1, self.encoder.tokens(completion))
            yield BenchRequest(messages, self.encoder.count(messages), num_out)


Workload = (MixWorkload | SharedPrefixWorkload | NoReuseWorkload | ShareGptWorkload
            | TraceWorkload)
# What check_workload_flags loads once: sharegpt's conversations, mooncake-trace's records.
Dataset = ShareGptData | tuple[TraceRecord, ...]


def _output_len(cfg: RunConfig) -> int:
    return int(cfg.output_len or DEFAULT_OUTPUT_LEN)


def check_workload_flags(cfg: RunConfig) -> Dataset | None:
    """Fail fast on bad workload flags (before any tokenizer or server); the dataset,
    loaded, for ``sharegpt`` and ``mooncake-trace``."""
    if cfg.workload not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.workload!r}; choose one of "
                         f"{', '.join(WORKLOADS)}")
    if cfg.workload == "chat-mix":
        parse_mix(cfg.mix)
        _mix_shift(cfg)
    elif cfg.mix_then:
        raise ValueError("--mix-then needs --workload chat-mix")
    if cfg.workload in ("shared-prefix", "no-reuse"):
        _shape(cfg)
    records = check_trace_flags(cfg)
    if cfg.workload == "sharegpt":
        return _sharegpt_data(cfg)
    return records


def _sharegpt_data(cfg: RunConfig) -> ShareGptData:
    """The conversations ``--dataset`` names (sharegpt needs one)."""
    if not cfg.dataset:
        raise ValueError("--workload sharegpt needs --dataset PATH (.json or .jsonl)")
    return load_sharegpt(cfg.dataset)


def _shape(cfg: RunConfig) -> SharedPrefixShape:
    """shared-prefix's (and no-reuse's) sizes."""
    return SharedPrefixShape(cfg.num_system_prompts, cfg.system_prompt_len, cfg.num_users,
                             cfg.num_turns, cfg.turn_input_len, _output_len(cfg))


def _mix_shift(cfg: RunConfig) -> tuple[list[LengthClass] | None, int]:
    """``--mix-then`` and where the load shifts to it (``--mix-shift-at``)."""
    if not cfg.mix_then:
        return None, 0
    then = parse_mix(cfg.mix_then)
    shift_at = cfg.mix_shift_at
    if shift_at is None:
        if not cfg.num_requests:
            raise ValueError("--mix-then without --num-requests needs --mix-shift-at")
        shift_at = cfg.num_requests // 2
    if shift_at < 0:
        raise ValueError("--mix-shift-at must be >= 0")
    return then, shift_at


def make_workload(cfg: RunConfig, encoder: PromptEncoder, seed: int,
                  dataset: Dataset | None = None) -> Workload:
    """The workload ``cfg.workload`` names (as ``pdserve bench run`` defines it);
    ``dataset``: ``check_workload_flags``'."""
    if cfg.workload == "random":
        return MixWorkload(encoder, [LengthClass(1.0, cfg.input_len, _output_len(cfg))],
                           cfg.range_ratio, seed)
    if cfg.workload == "chat-mix":
        then, shift_at = _mix_shift(cfg)
        return MixWorkload(encoder, parse_mix(cfg.mix), cfg.range_ratio, seed, then,
                           shift_at)
    if cfg.workload == "shared-prefix":
        return SharedPrefixWorkload(encoder, _shape(cfg), seed)
    if cfg.workload == "no-reuse":
        return NoReuseWorkload(encoder, _shape(cfg), seed)
    if cfg.workload == "sharegpt":
        data = dataset if isinstance(dataset, ShareGptData) else _sharegpt_data(cfg)
        return ShareGptWorkload(encoder, data, cfg.output_len, seed)
    if cfg.workload == "mooncake-trace":
        records = dataset if isinstance(dataset, tuple) else None
        return trace_workload(cfg, encoder.vocab, seed, records)
    raise ValueError(f"unknown workload {cfg.workload!r}; choose one of {', '.join(WORKLOADS)}")


def workload_info(workload: Workload, max_model_len: int | None = None) -> dict[str, Any]:
    """What the result records of the workload (``max_model_len``: the run's context, past
    which the runner skipped prompts)."""
    if isinstance(workload, ShareGptWorkload):
        return {"dataset_entries": len(workload.pairs),
                "dataset_malformed": workload.num_malformed}
    if isinstance(workload, TraceWorkload):
        return workload.info(max_model_len)
    return {}
