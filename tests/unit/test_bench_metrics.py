"""``pdserve bench`` metrics: timings read from a constructed SSE stream, and the summary's
numbers against hand-computed ones (vLLM's definitions; goodput inclusive at the SLO)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pdserve.bench.load import client as bench_client
from pdserve.bench.load.metrics import RequestRecord, Slo, stats, summarize


def _events(*chunks: dict) -> list[str]:
    return [json.dumps(c) for c in chunks] + ["[DONE]"]


def _choice(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


def test_a_stream_of_timestamps_gives_ttft_itl_e2e_tpot(monkeypatch: pytest.MonkeyPatch) -> None:
    # Sent at 10.0; token chunks at 10.5, 10.75, 11.0, 11.5; usage at 12.0; [DONE] at 12.5.
    clock: Iterator[float] = iter([10.5, 10.75, 11.0, 11.5, 12.0, 12.5])
    monkeypatch.setattr(bench_client.time, "perf_counter", lambda: next(clock))
    record = RequestRecord(prompt_tokens=0)
    stream = bench_client._Stream(10.0, record)
    usage = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 4,
                                      "prompt_tokens_details": {"cached_tokens": 3}}}
    for data in _events(_choice("a"), _choice("b"), _choice("c"), _choice("d"), usage):
        stream.on_event(data)
    stream.finish()
    assert record.ttft_s == 0.5
    assert record.itls_s == [0.25, 0.25, 0.5]
    assert record.e2e_s == 1.5  # the last token chunk, not the usage chunk
    assert (record.prompt_tokens, record.output_tokens, record.cached_tokens) == (7, 4, 3)
    assert record.tpot_s == pytest.approx((1.5 - 0.5) / 3)  # excludes the first token


def test_a_stream_without_done_or_with_an_error_event_fails_with_its_kind() -> None:
    stream = bench_client._Stream(0.0, RequestRecord(prompt_tokens=1))
    stream.on_event(json.dumps(_choice("a")))
    with pytest.raises(bench_client.RequestFailed) as cut:
        stream.finish()
    assert cut.value.kind == "incomplete"
    with pytest.raises(bench_client.RequestFailed) as err:
        stream.on_event(json.dumps({"error": {"message": "deadline", "code": 504}}))
    assert err.value.kind == "stream_error"
    empty = bench_client._Stream(0.0, RequestRecord(prompt_tokens=1))
    empty.on_event("[DONE]")
    with pytest.raises(bench_client.RequestFailed) as none:
        empty.finish()
    assert none.value.kind == "no_tokens"


def _rec(ttft: float, e2e: float, out: int, prompt: int = 10, cached: int = 0,
         itls: list[float] | None = None, error: str | None = None) -> RequestRecord:
    return RequestRecord(prompt, out, cached, ttft, e2e, itls or [], 0.0, error)


def test_summary_matches_hand_computed_values() -> None:
    records = [
        _rec(0.5, 1.5, 5, itls=[0.25, 0.25, 0.25, 0.25], cached=5),  # TPOT 0.25
        _rec(1.0, 3.0, 3, itls=[1.0, 1.0]),                          # TPOT 1.0
        _rec(1.5, 1.5, 1),                                           # one token: no TPOT
        _rec(2.0, 2.5, 2, itls=[0.5], prompt=20),                    # TPOT 0.5
        RequestRecord(10, error="http_429"), RequestRecord(10, error="timeout"),
        RequestRecord(10, error="http_429"),
    ]
    out = summarize(records, duration_s=4.0, slo=Slo())
    assert (out["completed"], out["failed"]) == (4, 3)
    assert out["errors"] == {"http_429": 2, "timeout": 1}
    assert (out["input_tokens"], out["output_tokens"], out["cached_tokens"]) == (50, 11, 5)
    assert out["cached_token_share"] == 0.1
    assert out["request_throughput"] == 1.0 and out["output_throughput"] == 11 / 4
    assert out["total_token_throughput"] == 61 / 4
    # ttfts 0.5 1.0 1.5 2.0: linear percentiles
    assert out["ttft_s"] == pytest.approx({"mean": 1.25, "p50": 1.25, "p90": 1.85, "p99": 1.985})
    assert out["tpot_s"]["mean"] == pytest.approx((0.25 + 1.0 + 0.5) / 3)
    assert out["tpot_s"]["p50"] == pytest.approx(0.5)
    assert out["itl_s"]["mean"] == pytest.approx((4 * 0.25 + 2 * 1.0 + 0.5) / 7)
    assert out["e2e_s"]["p50"] == pytest.approx(2.0)
    assert (out["good"], out["goodput"], out["goodput_share"]) == (4, 1.0, 1.0)  # no SLO


def test_goodput_counts_a_request_exactly_at_the_slo_and_not_one_past_it() -> None:
    slo = Slo.parse("ttft=500ms,tpot=0.25s,e2e=1.5s")
    assert (slo.ttft_s, slo.tpot_s, slo.e2e_s) == (0.5, 0.25, 1.5)
    at_edge = _rec(0.5, 1.5, 5)  # TPOT (1.5 - 0.5) / 4 = 0.25: every value equals its SLO
    assert at_edge.tpot_s == 0.25
    past_ttft = _rec(0.5000001, 1.5, 5)
    past_e2e = _rec(0.5, 1.5000001, 9)  # TPOT 0.125, e2e just past
    one_token = _rec(0.25, 0.25, 1)  # TPOT counts as 0 for goodput
    out = summarize([at_edge, past_ttft, past_e2e, one_token], duration_s=2.0, slo=slo)
    assert out["good"] == 2
    assert out["goodput"] == 1.0 and out["goodput_share"] == 0.5
    assert out["slo"] == {"ttft_s": 0.5, "tpot_s": 0.25, "e2e_s": 1.5}


@pytest.mark.parametrize("text", ["ttft=2", "ttft=fast", "latency=2s", "ttft=2s,ttft=1s",
                                  "ttft=-1s", "ttft:2s", "ttft=2s,"])
def test_a_bad_slo_string_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="--slo"):
        Slo.parse(text)


def test_no_samples_give_null_statistics() -> None:
    assert stats([]) == {"mean": None, "p50": None, "p90": None, "p99": None}
    out = summarize([RequestRecord(5, error="connect")], 1.0, Slo.parse("ttft=1s"))
    assert out["ttft_s"]["p50"] is None and out["goodput"] == 0.0 and out["completed"] == 0


def test_chunks_without_text_are_not_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """A role-only opening chunk and a closing chunk with only finish_reason move neither
    TTFT nor E2E and add no ITL."""
    clock: Iterator[float] = iter([1.0, 2.0, 3.0, 4.0, 5.0])
    monkeypatch.setattr(bench_client.time, "perf_counter", lambda: next(clock))
    record = RequestRecord(prompt_tokens=0)
    stream = bench_client._Stream(0.0, record)
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    for data in _events(role, _choice("a"), {"choices": [{"text": "b"}]}, finish):
        stream.on_event(data)
    stream.finish()
    assert (record.ttft_s, record.itls_s, record.e2e_s) == (2.0, [1.0], 3.0)
    assert record.output_tokens == 2  # no usage chunk: counted chunks
