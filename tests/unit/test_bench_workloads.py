"""``pdserve bench`` workloads: ShareGPT files as users bring them (malformed entries
skipped and counted), exact prompt lengths through the tokenizer and chat template,
seeded reproducibility, shared prefixes across a user's turns."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.bench.load.config import RunConfig
from pdserve.bench.workload.generators import check_workload_flags, make_workload, parse_mix
from pdserve.bench.workload.prompts import PromptEncoder
from pdserve.bench.workload.sharegpt import load_sharegpt
from pdserve.cli.bench_flags import add_run_flags, run_config

GOOD = {"conversations": [{"from": "human", "value": "Why is the sky blue?"},
                          {"from": "gpt", "value": "Rayleigh scattering of sunlight."}]}
MALFORMED = [
    "not an object",
    {"id": "no conversations"},
    {"conversations": "not a list"},
    {"conversations": [{"from": "human", "value": "one turn only"}]},
    {"conversations": [{"from": "human", "value": 42}, {"from": "gpt", "value": "x"}]},
    {"conversations": [{"from": "human", "value": "   "}, {"from": "gpt", "value": "x"}]},
    {"conversations": ["a", "b"]},
]


def _args(*argv: str) -> RunConfig:
    p = argparse.ArgumentParser()
    add_run_flags(p)
    return run_config(p.parse_args(["--base-url", "http://x", *argv]))


def test_sharegpt_json_skips_malformed_entries_and_counts_them(tmp_path: Path) -> None:
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([GOOD, *MALFORMED, GOOD]))
    data = load_sharegpt(path)
    assert data.pairs == [("Why is the sky blue?", "Rayleigh scattering of sunlight.")] * 2
    assert data.num_malformed == len(MALFORMED)


def test_sharegpt_jsonl_counts_lines_that_are_not_json(tmp_path: Path) -> None:
    path = tmp_path / "sg.jsonl"
    path.write_text("\n".join([json.dumps(GOOD), "{broken", "", json.dumps(MALFORMED[1])]))
    data = load_sharegpt(path)
    assert len(data.pairs) == 1 and data.num_malformed == 2


@pytest.mark.parametrize(("name", "text", "match"), [
    ("empty.json", "", "not JSON"),
    ("list.json", "[]", "no usable ShareGPT entry"),
    ("bad.json", json.dumps(MALFORMED), r"no usable ShareGPT entry \(7 malformed\)"),
    ("obj.json", "{}", "expected a JSON list"),
    ("empty.jsonl", "", "no usable ShareGPT entry"),
])
def test_an_empty_or_malformed_dataset_is_one_clear_error(tmp_path: Path, name: str, text: str,
                                                          match: str) -> None:
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError, match=match):
        load_sharegpt(tmp_path / name)
    with pytest.raises(ValueError, match="No such file"):
        load_sharegpt(tmp_path / "missing.json")


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_random_prompts_have_the_exact_token_count_the_endpoint_sees(tokenizer: Any,
                                                                    endpoint: str) -> None:
    encoder = PromptEncoder(tokenizer, endpoint)
    args = _args("--input-len", "300", "--output-len", "20", "--range-ratio", "0.5")
    requests = list(itertools.islice(make_workload(args, encoder, seed=5), 12))
    lengths = [r.prompt_tokens for r in requests]
    assert len(set(lengths)) > 1 and all(150 <= n <= 450 for n in lengths)
    for r in requests:  # as the router counts them (preprocess.py)
        if endpoint == "chat":
            text = tokenizer.apply_chat_template(r.messages, add_generation_prompt=True,
                                                 tokenize=False)
            assert len(tokenizer.encode(text, add_special_tokens=False)) == r.prompt_tokens
        else:
            assert len(tokenizer.encode(r.messages[0]["content"])) == r.prompt_tokens
        assert 10 <= r.output_tokens <= 30
    again = list(itertools.islice(make_workload(args, encoder, seed=5), 12))
    other = list(itertools.islice(make_workload(args, encoder, seed=6), 12))
    assert again == requests and other != requests


def test_chat_mix_draws_its_classes_in_their_shares(tokenizer: Any) -> None:
    assert [c.share for c in parse_mix("3:10:5,1:40:2")] == [0.75, 0.25]
    encoder = PromptEncoder(tokenizer, "chat")
    args = _args("--workload", "chat-mix", "--mix", "0.7:50:9,0.3:120:3")
    requests = list(itertools.islice(make_workload(args, encoder, seed=0), 200))
    short = [r for r in requests if r.output_tokens == 9]
    assert {r.prompt_tokens for r in short} == {50}
    assert {r.prompt_tokens for r in requests if r.output_tokens == 3} == {120}
    assert 0.6 <= len(short) / len(requests) <= 0.8  # 140 expected, sd ~6.5


def test_chat_mix_shifts_to_its_second_mix_half_way(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer, "chat")
    args = _args("--workload", "chat-mix", "--mix", "1:50:9", "--mix-then", "1:90:3",
                 "--num-requests", "10")
    requests = list(itertools.islice(make_workload(args, encoder, seed=0), 10))
    assert [r.output_tokens for r in requests] == [9] * 5 + [3] * 5
    assert {r.prompt_tokens for r in requests[5:]} == {90}
    at = _args("--workload", "chat-mix", "--mix", "1:50:9", "--mix-then", "1:90:3",
               "--mix-shift-at", "2", "--duration-s", "5")
    assert [r.output_tokens for r in itertools.islice(make_workload(at, encoder, 0), 4)] == [
        9, 9, 3, 3]
    with pytest.raises(ValueError, match="--mix-shift-at"):
        check_workload_flags(_args("--workload", "chat-mix", "--mix-then", "1:90:3",
                                   "--duration-s", "5"))
    with pytest.raises(ValueError, match="chat-mix"):
        check_workload_flags(_args("--mix-then", "1:90:3"))


def test_shared_prefix_turns_extend_their_users_conversation(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer, "chat")
    args = _args("--workload", "shared-prefix", "--num-system-prompts", "2",
                 "--system-prompt-len", "40", "--num-users", "3", "--num-turns", "2",
                 "--turn-input-len", "10", "--output-len", "8")
    requests = list(itertools.islice(make_workload(args, encoder, seed=1), 12))
    first, second = requests[:3], requests[3:6]  # all users' turn 0, then turn 1
    for a, b in zip(first, second, strict=True):
        assert b.messages[:2] == a.messages and len(b.messages) == 4
        assert b.messages[2]["role"] == "assistant" and b.prompt_tokens > a.prompt_tokens
    systems = [r.messages[0]["content"] for r in first]
    assert systems[0] == systems[2] != systems[1]  # users share the 2 system prompts
    assert encoder.tokens(systems[0]) == 40
    assert requests[6].messages[1] != first[0].messages[1]  # then new users


def test_bad_workload_flags_fail_before_any_tokenizer(tmp_path: Path) -> None:
    for argv, match in [(["--workload", "chat-mix", "--mix", "0.5:10"], "--mix"),
                        (["--workload", "chat-mix", "--mix", "0:10:5"], "share > 0"),
                        (["--workload", "sharegpt"], "--dataset"),
                        (["--workload", "shared-prefix", "--num-users", "0"], ">= 1")]:
        with pytest.raises(ValueError, match=match):
            check_workload_flags(_args(*argv))


MULTI_TURN = ("--num-system-prompts", "2", "--system-prompt-len", "200", "--num-users", "4",
              "--num-turns", "3", "--turn-input-len", "30", "--output-len", "20")


def _token_ids(encoder: PromptEncoder, messages: Any) -> list[int]:
    """The prompt's token ids as the endpoint encodes them (what the engine caches)."""
    text = encoder._text(messages)
    return encoder.tokenizer.encode(text, add_special_tokens=encoder.endpoint == "completions")


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_prompts_extend_the_previous_turn_token_for_token(tokenizer: Any,
                                                                     endpoint: str) -> None:
    """The KV tiers' workload (shared-prefix): turn k's prompt, as token ids, starts with
    turn k-1's whole prompt, so everything but the new turn could come from a cache."""
    encoder = PromptEncoder(tokenizer, endpoint)
    args = _args("--workload", "shared-prefix", *MULTI_TURN)
    requests = list(itertools.islice(make_workload(args, encoder, seed=3), 12))
    assert requests == list(itertools.islice(make_workload(args, encoder, seed=3), 12))
    assert requests != list(itertools.islice(make_workload(args, encoder, seed=4), 12))
    ids = [_token_ids(encoder, r.messages) for r in requests]
    assert [len(i) for i in ids] == [r.prompt_tokens for r in requests]
    for k in range(4, 12):  # 4 users: request k is the turn after request k - 4
        assert ids[k][:len(ids[k - 4])] == ids[k - 4]
        assert len(ids[k]) > len(ids[k - 4]) + 20 + 30  # the stand-in reply and the new turn
    for r in requests:
        contents = [encoder.tokens(m["content"]) for m in r.messages]
        assert contents[0] == 200 and r.output_tokens == 20
        assert contents[1::2] == [30] * (len(contents) // 2)  # user turns
        assert contents[2::2] == [20] * (len(contents) // 2 - 1)  # stand-in replies
    systems = [r.messages[0]["content"] for r in requests]
    assert systems[:4] * 3 == systems and len(set(systems)) == 2  # 4 users share 2


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_no_reuse_control_has_the_same_shape_and_shares_nothing(tokenizer: Any,
                                                                endpoint: str) -> None:
    encoder = PromptEncoder(tokenizer, endpoint)
    shared = list(itertools.islice(make_workload(
        _args("--workload", "shared-prefix", *MULTI_TURN), encoder, seed=3), 12))
    args = _args("--workload", "no-reuse", *MULTI_TURN)
    control = list(itertools.islice(make_workload(args, encoder, seed=3), 12))
    assert control == list(itertools.islice(make_workload(args, encoder, seed=3), 12))
    assert control != list(itertools.islice(make_workload(args, encoder, seed=4), 12))
    for a, b in zip(shared, control, strict=True):  # the same lengths, message by message
        assert [m["role"] for m in a.messages] == [m["role"] for m in b.messages]
        assert [encoder.tokens(m["content"]) for m in a.messages] == [
            encoder.tokens(m["content"]) for m in b.messages]
        assert abs(a.prompt_tokens - b.prompt_tokens) <= 1 and a.output_tokens == b.output_tokens
    ids = [_token_ids(encoder, r.messages) for r in control]
    longest = max(_common_prefix(a, b) for a, b in itertools.combinations(ids, 2))
    assert longest <= 6  # the template's opening ('<|im_start|>system\n'), never a KV block
    contents = [m["content"] for r in control for m in r.messages]
    assert len(set(contents)) == len(contents)


def test_the_prefix_hit_rate_reaches_compare_tables() -> None:
    from pdserve.bench.compare.report import CompareReport, RateRun, SystemResult, render_markdown
    from pdserve.bench.load.metrics import RequestRecord, Slo, summarize

    def run(cached: int) -> dict[str, Any]:
        records = [RequestRecord(prompt_tokens=100, output_tokens=4, cached_tokens=cached,
                                 ttft_s=0.1, e2e_s=0.4)] * 2
        return summarize(records, 1.0, Slo())

    assert run(25)["cached_token_share"] == 0.25
    off = SystemResult("off", "pdserve", {}, runs=[RateRun(1.0, run(10))])
    host = SystemResult("host", "pdserve", {}, runs=[RateRun(1.0, run(40))])
    md = render_markdown(CompareReport({}, {}, {}, [1.0], [off, host], "off"))
    header, _, off_row, host_row = md.split("## 1 req/s")[1].strip().splitlines()[2:6]
    assert "prefix hit" in header
    assert "| 10.0% |" in off_row and "| 40.0% (4.00×) |" in host_row
