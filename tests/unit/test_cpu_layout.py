"""``pdserve up``'s core layouts: auto splits wherever there are two cores or more."""

from __future__ import annotations

import pytest

from pdserve.launch import cpu_layout


@pytest.mark.parametrize(("cores", "layout", "want"), [
    ({0, 1}, "auto", (["0"], ["1"])),
    ({0, 1, 2, 3}, "auto", (["0,1"], ["2,3"])),
    ({0, 1}, "shared", (["0,1"], ["0,1"])),
    ({0}, "auto", (["0"], ["0"])),  # one core: nothing to split
])
def test_core_sets(monkeypatch: pytest.MonkeyPatch, cores: set[int], layout: str,
                   want: tuple[list[str], list[str]]) -> None:
    monkeypatch.setattr(cpu_layout.os, "sched_getaffinity", lambda pid: cores)
    assert cpu_layout.core_sets(1, 1, layout) == want


def test_two_prefill_engines_split_their_half(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_layout.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert cpu_layout.core_sets(2, 1, "auto") == (["0,1", "2,3"], ["4,5,6,7"])


@pytest.mark.parametrize(("num_prefill", "num_decode", "want"), [
    (0, 2, ([], ["0", "1"])),  # decode alone: one core each, none idle
    (0, 1, ([], ["0,1"])),
    (2, 0, (["0", "1"], [])),
])
def test_a_role_with_no_engines_leaves_its_cores_to_the_other(
        monkeypatch: pytest.MonkeyPatch, num_prefill: int, num_decode: int,
        want: tuple[list[str], list[str]]) -> None:
    monkeypatch.setattr(cpu_layout.os, "sched_getaffinity", lambda pid: {0, 1})
    assert cpu_layout.core_sets(num_prefill, num_decode, "auto") == want
