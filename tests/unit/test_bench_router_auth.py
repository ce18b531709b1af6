"""``pdserve bench router-cost --auth``: one latency run per entry, in order, the medians of
each mode side by side, and the in-process cost of the router's signing and checking."""

from __future__ import annotations

import pytest

from pdserve.bench.micro.configs import RouterCostConfig
from pdserve.bench.micro.router_cost.auth import AUTH_COMPARED, auth_work_us, run_auth


def test_auth_modes_are_checked() -> None:
    with pytest.raises(ValueError, match="--auth"):
        RouterCostConfig(auth=("bearer",))
    with pytest.raises(ValueError, match="--auth"):
        RouterCostConfig(auth=())


def test_runs_follow_the_order_given_and_medians_sit_side_by_side(
        capsys: pytest.CaptureFixture[str]) -> None:
    order: list[str] = []
    values = iter([1.0, 2.0, 3.0, 6.0])

    def fake(cfg: RouterCostConfig, auth: str) -> dict[str, float]:
        order.append(auth)
        v = next(values)
        return {k: v for k in AUTH_COMPARED}

    numbers = run_auth(RouterCostConfig(auth=("none", "secret", "none", "secret")), fake)
    assert order == ["none", "secret", "none", "secret"]
    medians = numbers["auth"]["medians"]  # type: ignore[index]
    assert medians["none"]["req_per_s"] == 2.0 and medians["secret"]["req_per_s"] == 4.0
    assert "secret/none" in capsys.readouterr().out


def test_one_mode_keeps_the_flat_numbers() -> None:
    numbers = run_auth(RouterCostConfig(), lambda cfg, auth: {"req_per_s": 5.0})
    assert numbers == {"req_per_s": 5.0}


def test_the_auth_work_per_call_is_measured() -> None:
    assert 0 < auth_work_us(calls=200) < 10_000
