"""``pdserve bench link-aware``'s arithmetic (no hosts, no engine): the second token's
time, the decisions a run added, the on/off ratios, and the config's checks."""

from __future__ import annotations

import pytest

from pdserve.bench.load.metrics import RequestRecord
from pdserve.bench.micro.host_configs import LinkAwareConfig
from pdserve.bench.micro.link_aware import _diff, _summary, report


def _record(ttft_s: float, itls_s: list[float], error: str | None = None) -> RequestRecord:
    return RequestRecord(prompt_tokens=1024, output_tokens=len(itls_s) + 1, ttft_s=ttft_s,
                         e2e_s=ttft_s + sum(itls_s), itls_s=itls_s, error=error)


def test_the_second_token_is_the_first_plus_the_first_gap() -> None:
    rows = _summary([_record(1.0, [3.0, 0.1]), _record(2.0, [0.5, 0.1]),
                     _record(9.0, [], error="timeout")], 10.0, {"local/slow_link": 2.0})
    assert (rows["requests"], rows["failed"]) == (3, 1)
    assert rows["second_token_s"]["p50"] == pytest.approx(3.25)  # 4.0 and 2.5
    assert rows["ttft_s"]["p50"] == pytest.approx(1.5)


def test_decisions_are_what_the_run_added() -> None:
    assert _diff({"remote/long_prompt": 14.0, "local/slow_link": 3.0},
                 {"remote/long_prompt": 2.0, "local/slow_link": 3.0}) == {
        "remote/long_prompt": 12.0}


def test_the_report_gives_on_over_off_per_rate() -> None:
    config = LinkAwareConfig(link_gbit="0.1")
    on = {"link_gbit": 0.1, "link_aware": "on", "failed": 0, "decisions": {"local/slow_link": 2},
          **_summary([_record(2.0, [0.2])], 5.0, {})}
    off = {"link_gbit": 0.1, "link_aware": "off", "failed": 0,
           "decisions": {"remote/long_prompt": 2}, **_summary([_record(1.0, [19.0])], 5.0, {})}
    on["decisions"], off["decisions"] = {"local/slow_link": 2}, {"remote/long_prompt": 2}
    text = report([on, off], config)
    assert "| 0.1 | on | 2000 | 2000 | 2200 | 2200 |" in text
    assert "TTFT p50 2.00x" in text and "2nd token p50 0.11x" in text


def test_the_report_gives_each_prefills_prompt_tokens_and_the_kv_pulled() -> None:
    row = {"link_gbit": 0.1, "link_aware": "on", "failed": 0, "decisions": {},
           **_summary([_record(2.0, [0.2])], 5.0, {}),
           "kv": {"bytes_received": 94e6, "encoded_pulls": 2.0, "prefill_tokens": 1024.0,
                  "prefill-fast_tokens": 5120.0}}
    row["decisions"] = {"remote/long_prompt": 4}
    text = report([row], LinkAwareConfig(link_gbit="0.1", prefills=2))
    assert "| remote/long_prompt 4 | 94 | 2 | prefill-fast 5120, prefill 1024 |" in text


@pytest.mark.parametrize("bad", [{"link_gbit": "0"}, {"prompt_tokens": ""}, {"rate": 0.0},
                                 {"prefills": 3}])
def test_a_bad_config_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LinkAwareConfig(**bad)  # type: ignore[arg-type]
