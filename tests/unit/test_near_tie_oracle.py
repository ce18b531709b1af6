"""The bf16 P/D oracle (``integration.pd_cases.near_tie_divergence``) can fail: equal up
to a flip the reference scored as a near-tie passes; any other difference does not."""

from __future__ import annotations

from integration.pd_cases import near_tie_divergence

TOPS = [{1: -0.1, 9: -3.0}, {2: -0.50, 7: -0.60, 8: -2.5}, {3: -0.2}]


def test_equal_or_flipped_at_a_near_tie_passes() -> None:
    assert near_tie_divergence([1, 2, 3], [1, 2, 3], TOPS) is None
    assert near_tie_divergence([1, 7, 5], [1, 2, 3], TOPS) is None  # 0.1 nats apart


def test_any_other_difference_fails() -> None:
    assert "2.000 nats below" in (near_tie_divergence([1, 8, 3], [1, 2, 3], TOPS) or "")
    assert "not among" in (near_tie_divergence([4, 2, 3], [1, 2, 3], TOPS) or "")
    assert "2 of them" in (near_tie_divergence([1, 2], [1, 2, 3], TOPS) or "")
