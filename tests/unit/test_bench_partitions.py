"""``pdserve bench partitions``' arithmetic (no hosts, no engine): a fault's row from its
trials, a trial never made whole, the report, and the config's checks."""

from __future__ import annotations

import pytest

from pdserve.bench.micro.host_configs import PARTITIONS, PartitionsConfig
from pdserve.bench.micro.partitions import Trial, report, summary


def _trial(fault: str, whole: float | None, answered: int = 3, exact: int = 3,
           errors: tuple[str, ...] = (), **counts: float) -> Trial:
    return Trial(fault, 0, whole, answered, exact, list(errors), 5.0, dict(counts))


def test_a_fault_row_gives_heal_to_whole_over_its_trials_and_sums_what_moved() -> None:
    config = PartitionsConfig(faults="router-decode,frozen-decode", reps=2)
    rows = summary([_trial("router-decode", 0.5, migrations=1),
                    _trial("router-decode", 2.5, migrations=2),
                    _trial("frozen-decode", 1.0)], config)
    first, second = rows
    assert first["fault"] == "router-decode" and first["whole"] == 2
    assert first["heal_to_whole_s"]["p50"] == pytest.approx(1.5)
    assert first["heal_to_whole_s"]["max"] == pytest.approx(2.5)
    assert first["counts"] == {"migrations": 3}
    assert (first["streams"], first["answered"], first["exact"]) == (6, 6, 6)
    assert second["reps"] == 1 and second["counts"] == {}


def test_times_seen_in_trials_give_their_longest_not_their_sum() -> None:
    config = PartitionsConfig(faults="worker-etcd", reps=2)
    (row,) = summary([_trial("worker-etcd", 1.0, left_view_s=3.5),
                      _trial("worker-etcd", 1.0, left_view_s=4.25)], config)
    assert row["counts"] == {"left_view_s": 4.25}


def test_a_trial_never_whole_counts_against_the_fault_and_shows_in_the_report() -> None:
    config = PartitionsConfig(faults="worker-etcd", reps=2)
    rows = summary([_trial("worker-etcd", None, answered=2, exact=1,
                           errors=("HTTP 504: deadline",)),
                    _trial("worker-etcd", 0.7)], config)
    (row,) = rows
    assert (row["whole"], row["reps"]) == (1, 2)
    assert row["heal_to_whole_s"]["max"] == pytest.approx(0.7)  # of those made whole
    text = report(rows, config)
    assert "| worker-etcd | 0.70 | 0.70 | 1/2 | 5/6 | 4/6 |" in text
    assert "HTTP 504: deadline" in text


def test_every_fault_runs_by_default_and_bad_values_are_refused() -> None:
    assert PartitionsConfig().fault_list == list(PARTITIONS)
    for bad in ({"faults": "router-decode,cable-cut"}, {"faults": ""},
                {"cut_after_tokens": 32}, {"cut_after_tokens": 0}, {"streams": 0},
                {"pull_link_gbit": 0.0}):
        with pytest.raises(ValueError):
            PartitionsConfig(**bad)
