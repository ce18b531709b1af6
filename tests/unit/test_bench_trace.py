"""``pdserve bench run --workload mooncake-trace``: a Mooncake trace's hash_ids become
token blocks (equal ids equal blocks, the trace's prefixes prefixes in tokens), lengths
and times scale as the flags say, the infinite-cache bound on the committed sample is a
plain reference computation's (and cache-sim's), bad files and flags are one clear error,
and the runner sends the token ids at the trace's times."""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.bench.load.client import Endpoint
from pdserve.bench.load.config import RunConfig
from pdserve.bench.load.runner import Runner, Schedule
from pdserve.bench.micro.cache_sim.replay import replay
from pdserve.bench.micro.cache_sim.trace import load_trace as load_sim_trace
from pdserve.bench.workload.generators import check_workload_flags, make_workload, workload_info
from pdserve.bench.workload.mooncake import TraceScale, infinite_cache, load_trace
from pdserve.bench.workload.prompts import PromptEncoder
from pdserve.bench.workload.trace_replay import BlockTokens, TraceWorkload
from pdserve.cli.bench_flags import add_run_flags, run_config

SAMPLE = Path(__file__).parent.parent / "data" / "mooncake_conversation_sample.jsonl"
VOCAB = list(range(1000, 50_000))


def _args(*argv: str) -> RunConfig:
    p = argparse.ArgumentParser()
    add_run_flags(p)
    return run_config(p.parse_args(["--base-url", "http://x", *argv]))


def _trace_args(*argv: str) -> RunConfig:
    return _args("--workload", "mooncake-trace", "--dataset", str(SAMPLE),
                 "--endpoint", "completions", *argv)


def _raw() -> list[dict[str, Any]]:
    return [json.loads(line) for line in SAMPLE.read_text().splitlines() if line.strip()]


def _blocks(ids: tuple[int, ...], size: int) -> list[tuple[int, ...]]:
    return [ids[i:i + size] for i in range(0, len(ids), size)]


def test_equal_hash_ids_give_equal_blocks_and_different_ones_differ() -> None:
    blocks = BlockTokens(VOCAB, 32, seed=7)
    assert blocks.block(5) == blocks.block(5) == BlockTokens(VOCAB, 32, seed=7).block(5)
    assert len(blocks.block(5)) == 32 and set(blocks.block(5)) <= set(VOCAB)
    distinct = {tuple(blocks.block(i)) for i in range(500)}
    assert len(distinct) == 500
    assert blocks.block(5) != BlockTokens(VOCAB, 32, seed=8).block(5)  # the seed matters


def test_the_traces_prefixes_are_prefixes_in_tokens() -> None:
    records = load_trace(SAMPLE)
    workload = TraceWorkload(records, TraceScale(block_tokens=16), VOCAB, seed=1)
    prompts = [r.prompt_ids or () for r in workload]
    assert len(prompts) == len(records) == 150
    num_shared_pairs = 0
    for i, a in enumerate(records):
        for j in range(i + 1, len(records)):
            b = records[j]
            k = 0
            while (k < min(len(a.hash_ids), len(b.hash_ids))
                   and a.hash_ids[k] == b.hash_ids[k]):
                k += 1
            shared = min(k * 16, len(prompts[i]), len(prompts[j]))
            assert prompts[i][:shared] == prompts[j][:shared]
            num_shared_pairs += k > 0
            blocks_a, blocks_b = _blocks(prompts[i], 16), _blocks(prompts[j], 16)
            if k < min(len(blocks_a), len(blocks_b)):  # the first different id: other tokens
                n = min(len(blocks_a[k]), len(blocks_b[k]))
                assert blocks_a[k][:n] != blocks_b[k][:n]
    assert num_shared_pairs > 100  # the sample does share prefixes


def test_a_prompt_is_its_blocks_the_last_one_cut_to_the_scaled_length() -> None:
    records = load_trace(SAMPLE)
    scale = TraceScale(block_tokens=32)
    blocks = BlockTokens(VOCAB, 32, seed=3)
    for rec in records:
        ids = TraceWorkload([rec], scale, VOCAB, seed=3).request(0).prompt_ids or ()
        expected = [t for h in rec.hash_ids for t in blocks.block(h)]
        assert list(ids) == expected[:len(ids)]
        assert len(ids) == min(max(math.ceil(rec.input_length / 16),
                                   (len(rec.hash_ids) - 1) * 32 + 1), len(rec.hash_ids) * 32)


def test_lengths_and_times_scale_by_the_flags() -> None:
    raw = _raw()
    cfg = _trace_args("--trace-block-tokens", "64", "--trace-time-scale", "0.25",
                      "--trace-start", "10", "--num-requests", "40", "--output-len", "30")
    records = check_workload_flags(cfg)
    assert isinstance(records, tuple) and len(records) == 40
    requests = list(make_workload(cfg, PromptEncoderStub(), seed=0, dataset=records))
    assert len(requests) == 40
    t0 = raw[10]["timestamp"]
    for req, rec in zip(requests, raw[10:50], strict=True):
        assert req.prompt_tokens == len(req.prompt_ids or ()) == math.ceil(
            rec["input_length"] * 64 / 512)
        assert req.output_tokens == min(30, max(1, round(rec["output_length"] / 8)))
        assert req.arrival_s == pytest.approx((rec["timestamp"] - t0) / 1000 * 0.25)
        assert req.messages == []
    last_arrival_s = requests[-1].arrival_s
    assert last_arrival_s is not None
    assert requests[0].arrival_s == 0.0 and last_arrival_s > 0
    unscaled = list(make_workload(_trace_args("--num-requests", "3"), PromptEncoderStub(), 0))
    assert [r.prompt_tokens for r in unscaled] == [r["input_length"] for r in raw[:3]]
    assert [r.output_tokens for r in unscaled] == [r["output_length"] for r in raw[:3]]


def test_a_request_rate_scales_the_traces_times_to_that_mean_rate() -> None:
    raw = _raw()
    cfg = _trace_args("--request-rate", "4", "--trace-start", "10", "--num-requests", "40")
    requests = list(make_workload(cfg, PromptEncoderStub(), seed=0))
    span_s = (raw[49]["timestamp"] - raw[10]["timestamp"]) / 1000
    assert requests[-1].arrival_s == pytest.approx(40 / 4)  # n requests span n / rate
    for req, rec in zip(requests, raw[10:50], strict=True):  # the trace's spacing, scaled
        assert req.arrival_s == pytest.approx((rec["timestamp"] - raw[10]["timestamp"])
                                              / 1000 * 10 / span_s)
    info = workload_info(make_workload(cfg, PromptEncoderStub(), seed=0))["trace"]
    assert info["time_scale"] == pytest.approx(10 / span_s)


class PromptEncoderStub(PromptEncoder):
    """A PromptEncoder without a tokenizer: the trace workload only needs the vocabulary."""

    def __init__(self) -> None:
        self.endpoint = "completions"
        self._ids = VOCAB


def _reference_ratio(records: list[dict[str, Any]], block_tokens: int,
                     engine_block: int = 128) -> tuple[float, float, float]:
    """A plain infinite cache: a set of every id seen; a request hits its leading run
    (and an engine of ``engine_block``-token blocks whole blocks of it, never the last
    prompt token)."""
    seen: set[int] = set()
    hit = refs = hit_tok = tok = engine_tok = 0
    for r in records:
        ids = r["hash_ids"]
        n = 0
        for i in ids:
            if i not in seen:
                break
            n += 1
        length = min(max(math.ceil(r["input_length"] * block_tokens / 512),
                         (len(ids) - 1) * block_tokens + 1), len(ids) * block_tokens)
        hit, refs = hit + n, refs + len(ids)
        hit_tok += length if n == len(ids) else n * block_tokens
        engine_tok += engine_block * ((length - 1 if n == len(ids) else n * block_tokens)
                                      // engine_block)
        tok += length
        seen |= set(ids)
    return hit / refs, hit_tok / tok, engine_tok / tok


@pytest.mark.parametrize("block_tokens", [512, 64, 32])
def test_the_infinite_cache_ratio_is_the_reference_computations(block_tokens: int) -> None:
    bound = infinite_cache(load_trace(SAMPLE), TraceScale(block_tokens))
    blocks, tokens, engine = _reference_ratio(_raw(), block_tokens)
    assert bound.block_ratio == pytest.approx(blocks) and bound.token_ratio == pytest.approx(
        tokens)
    by_engine = infinite_cache(load_trace(SAMPLE), TraceScale(block_tokens), 128)
    assert by_engine.token_ratio == pytest.approx(engine)
    assert by_engine.token_ratio <= bound.token_ratio
    if block_tokens < 128:  # hits end mid engine block: the engine loses their tail
        assert by_engine.token_ratio < bound.token_ratio
    assert bound.block_ratio == pytest.approx(replay(load_sim_trace(SAMPLE), "infinite",
                                                     0).hit_ratio)
    assert 0 < bound.block_ratio < 1


def test_the_result_reports_the_scale_and_the_bound_of_the_requests_drawn() -> None:
    cfg = _trace_args("--trace-block-tokens", "32", "--trace-time-scale", "0.5",
                      "--num-requests", "60")
    workload = make_workload(cfg, PromptEncoderStub(), seed=0)
    requests = iter(workload)
    for _ in range(50):  # 50 drawn of the 60 loaded: the bound is theirs
        next(requests)
    info = workload_info(workload)["trace"]
    bound = infinite_cache(load_trace(SAMPLE, 0, 50), TraceScale(32))
    assert info["num_requests"] == 50
    assert info["infinite_cache_token_ratio"] == pytest.approx(bound.token_ratio)
    assert info["infinite_cache_block_ratio"] == pytest.approx(bound.block_ratio)
    assert bound.token_ratio != infinite_cache(load_trace(SAMPLE, 0, 60),
                                               TraceScale(32)).token_ratio
    assert (info["block_tokens"], info["length_factor"], info["time_scale"]) == (
        32, 1 / 16, 0.5)
    assert info["replay_span_s"] == pytest.approx(info["trace_span_s"] * 0.5)
    assert info["replay_span_s"] > 0
    assert info["infinite_cache_token_ratio_engine_block"]["128"] == pytest.approx(
        infinite_cache(load_trace(SAMPLE, 0, 50), TraceScale(32), 128).token_ratio)
    list(requests)
    assert workload_info(workload)["trace"]["num_requests"] == 60


def test_the_bound_leaves_out_the_prompts_the_runner_skips() -> None:
    records = load_trace(SAMPLE)
    workload = TraceWorkload(records, TraceScale(), VOCAB, seed=0)
    list(workload)
    info = workload_info(workload, max_model_len=4096)["trace"]
    fits = [r for r in records if r.input_length + r.output_length <= 4096]
    assert 0 < info["num_sendable"] == len(fits) < info["num_requests"] == 150
    assert info["infinite_cache_token_ratio"] == pytest.approx(
        infinite_cache(fits, TraceScale()).token_ratio)


@pytest.mark.parametrize(("text", "match"), [
    ("", "no records"),
    ("{broken\n", r":1: not JSON"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1}\n', "no 'hash_ids'"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": []}\n',
     "non-empty list"),
    ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1, -2]}\n',
     "integers >= 0"),
    ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}\n',
     '"input_length" must be an integer >= 1'),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}\n',
     "exceeds its 1 blocks"),
    ('{"timestamp": "x", "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
     '"timestamp" must be'),
    ('[1, 2]\n', "expected a JSON object"),
    ('{"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n'
     '{"timestamp": 3, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n',
     "timestamps go backwards"),
])
def test_a_bad_trace_is_one_clear_error(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        load_trace(path)
    assert str(path) in str(err.value)
    with pytest.raises(ValueError, match="No such file"):
        load_trace(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="no records after --trace-start 150"):
        load_trace(SAMPLE, start=150)


@pytest.mark.parametrize(("argv", "match"), [
    (["--workload", "mooncake-trace", "--endpoint", "completions"], "needs --dataset FILE"),
    (["--workload", "mooncake-trace", "--dataset", str(SAMPLE)], "--endpoint completions"),
    (["--workload", "mooncake-trace", "--dataset", str(SAMPLE), "--endpoint", "completions",
      "--request-rate", "2", "--trace-time-scale", "0.5"], "not both"),
    (["--workload", "mooncake-trace", "--dataset", str(SAMPLE), "--endpoint", "completions",
      "--request-rate", "2", "--num-requests", "5"], "all arrive at one time"),
    (["--workload", "mooncake-trace", "--dataset", str(SAMPLE), "--endpoint", "completions",
      "--trace-block-tokens", "1024"], "--trace-block-tokens must be in"),
    (["--workload", "mooncake-trace", "--dataset", str(SAMPLE), "--endpoint", "completions",
      "--trace-time-scale", "-1"], "--trace-time-scale must be"),
    (["--trace-block-tokens", "32"], "--trace-block-tokens needs --workload mooncake-trace"),
    (["--workload", "sharegpt", "--trace-start", "3"], "--trace-start needs"),
])
def test_bad_trace_flags_are_one_clear_error(argv: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        check_workload_flags(_args(*argv))


def _sse(num_prompt: int) -> bytes:
    chunk = {"choices": [{"index": 0, "text": "x"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": num_prompt, "completion_tokens": 1,
                                      "prompt_tokens_details": {"cached_tokens": 0}}}
    return (f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\n"
            "data: [DONE]\n\n").encode()


async def test_the_runner_sends_token_ids_at_the_traces_times(tokenizer: Any) -> None:
    sent: list[tuple[float, dict[str, Any]]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((time.perf_counter(), body))
        return httpx.Response(200, content=_sse(len(body["prompt"])),
                              headers={"content-type": "text/event-stream"})

    encoder = PromptEncoder(tokenizer, "completions")
    cfg = _trace_args("--trace-block-tokens", "16", "--trace-time-scale", "0.1",
                      "--trace-start", "20", "--num-requests", "8")
    workload = make_workload(cfg, encoder, seed=0)
    expected = list(make_workload(cfg, encoder, seed=0))
    ep = Endpoint("http://trace/v1", "m", "completions", ignore_eos=True)
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        start = time.perf_counter()
        out = await Runner(client, ep, encoder, None, False).run(
            workload, Schedule(8, None, math.inf, 1.0, None, 0))
    assert out.num_drawn == 8 and all(r.error is None for r in out.records)
    bodies = sorted(sent, key=lambda s: s[0])
    assert [b["prompt"] for _, b in bodies] == [list(r.prompt_ids or ()) for r in expected]
    assert all(set(b["prompt"]) <= set(encoder.vocab) for _, b in bodies)
    assert [b["max_tokens"] for _, b in bodies] == [r.output_tokens for r in expected]
    # Never before its time, and not long after (a busy machine delays a sleep's end).
    for (at, _), req in zip(bodies, expected, strict=True):
        assert req.arrival_s is not None
        assert req.arrival_s - 0.01 <= at - start <= req.arrival_s + 1.0
    assert expected[-1].arrival_s and expected[-1].arrival_s > 0.2  # times were not all 0
