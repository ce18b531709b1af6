"""``pdserve bench transfer --link-gbit``: the rates it takes, and a clear refusal of
others (the run itself, on two hosts, is the benchmark's: docs/benchmarks.md)."""

from __future__ import annotations

import pytest

from pdserve.bench.micro.configs import TransferConfig
from pdserve.cli.bench import build_parser


def test_link_rates_parse_in_order_and_none_means_loopback() -> None:
    assert TransferConfig(link_gbit="1,10,25").link_rates == [1.0, 10.0, 25.0]
    assert TransferConfig().link_rates == []


@pytest.mark.parametrize("rates", ["0", "1,-10"])
def test_a_rate_that_is_not_positive_is_refused(rates: str) -> None:
    with pytest.raises(ValueError, match="positive Gbit/s"):
        TransferConfig(link_gbit=rates)


def test_the_flag_reaches_the_config() -> None:
    args = build_parser().parse_args(["transfer", "--link-gbit", "2.5"])
    assert args.link_gbit == "2.5"
