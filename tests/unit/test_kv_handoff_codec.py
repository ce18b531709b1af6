"""When a P->D pull asks for encoded blocks (``kv_transfer/handoff_codec.py``): below the
break-even link rate and not above it, raw with no measured path, raw from a peer that
refused the encoding (until that is forgotten), and a meter sample that an encoded pull
left (wire bytes over link plus codec time) read back as the link's own rate, so the
decision does not stay encoded on a link that got fast."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.handoff_codec import (
    MIB,
    CodecCost,
    HandoffCodec,
    encoded_pull_pays,
    link_rate,
    prior_cost,
)
from pdserve.kv_transfer.links import LinkEstimate, LinkMeter

PEER = "10.0.0.7:7000"
RAW_PER_TOKEN = 8192.0  # what a token's raw KV weighs in these examples


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _link(bytes_per_s: float, bytes_per_token: float = RAW_PER_TOKEN) -> LinkEstimate:
    return LinkEstimate(PEER, bytes_per_s, bytes_per_token, 3, 1.0)


@pytest.mark.parametrize(("ratio", "ms_per_mib"), [(1.15, 5.0), (3.8, 3.0), (1.9, 0.5)])
def test_an_encoded_pull_pays_below_the_break_even_rate_and_not_above(
        ratio: float, ms_per_mib: float) -> None:
    cost = CodecCost(ratio, ms_per_mib * 1e-3 / MIB)
    even = (1 - 1 / ratio) / cost.s_per_byte
    assert encoded_pull_pays(0.9 * even, cost)
    assert not encoded_pull_pays(1.1 * even, cost)
    # the same rule as the times it stands for, per raw byte
    for rate in (0.5 * even, 2 * even):
        encoded, raw = 1 / (ratio * rate) + cost.s_per_byte, 1 / rate
        assert encoded_pull_pays(rate, cost) == (encoded < raw)


def test_no_measured_path_or_no_saving_pulls_raw() -> None:
    cost = CodecCost(1.2, 1e-9)
    assert not encoded_pull_pays(None, cost)
    assert not encoded_pull_pays(0.0, cost)
    assert not encoded_pull_pays(1.0, CodecCost(1.0, 1e-12))  # nothing saved
    assert not encoded_pull_pays(1.0, CodecCost(0.95, 1e-12))  # fp8 codes of a 1-byte cache
    assert not HandoffCodec("lossless", 60.0).encode(PEER, None, RAW_PER_TOKEN, 4)


def test_priors_follow_the_codec_and_the_element_size() -> None:
    assert prior_cost("lossless", 4).ratio == 1.15
    assert prior_cost("lossless", 2).ratio == 1.4
    assert prior_cost("int8", 4).ratio == pytest.approx(3.6)  # below the 3.765 measured
    assert prior_cost("fp8", 2).ratio == pytest.approx(1.8)  # below the 1.882 measured
    assert prior_cost("fp8", 1).ratio < 1  # never pays
    with pytest.raises(ValueError, match="valid: lossless, int8, fp8"):
        HandoffCodec("none", 60.0)


def test_a_thin_path_is_pulled_encoded_and_a_fast_one_raw() -> None:
    handoff = HandoffCodec("lossless", 60.0)
    even = (1 - 1 / 1.15) / (9e-3 / MIB)  # the float32 prior: ~14.5 MiB/s
    assert handoff.encode(PEER, _link(even / 10), RAW_PER_TOKEN, 4)
    assert not handoff.encode(PEER, _link(even * 10), RAW_PER_TOKEN, 4)


def test_a_refusing_peer_is_pulled_raw_until_the_refusal_is_forgotten() -> None:
    clock = Clock()
    handoff = HandoffCodec("int8", 5.0, clock)
    thin = _link(1 * MIB)
    assert handoff.encode(PEER, thin, RAW_PER_TOKEN, 4)
    handoff.refused_by(PEER)
    assert not handoff.encode(PEER, thin, RAW_PER_TOKEN, 4)
    assert handoff.encode("10.0.0.8:7000", thin, RAW_PER_TOKEN, 4)  # only that peer
    clock.now += 4.0
    assert not handoff.encode(PEER, thin, RAW_PER_TOKEN, 4)
    clock.now += 2.0
    assert handoff.encode(PEER, thin, RAW_PER_TOKEN, 4)


def test_the_cost_is_learned_from_encoded_pulls() -> None:
    handoff = HandoffCodec("lossless", 60.0)
    handoff.record(int(MIB // 2), int(MIB // 4), 1.0)  # too small to be a sample
    assert handoff.cost(4) == prior_cost("lossless", 4)
    handoff.record(int(12 * MIB), int(10 * MIB), 12 * 4e-3)  # ratio 1.2 at 4 ms/MiB
    cost = handoff.cost(4)
    assert (cost.ratio, cost.samples) == (pytest.approx(1.2), 1)
    assert cost.s_per_byte == pytest.approx(4e-3 / MIB)
    handoff.record(int(12 * MIB), int(12 * MIB), 12 * 40e-3)  # slow, saving nothing: pulled down
    assert handoff.cost(4).ratio < 1.2 and handoff.cost(4).samples == 2
    assert handoff.cost(4).s_per_byte > 10e-3 / MIB


def test_an_encoded_sample_is_read_back_as_the_links_own_rate() -> None:
    """The meter records an encoded pull as wire bytes over its whole time (the router's
    price is then the time the pull took); read plainly it would understate the link by
    the codec's share, and keep an int8 handoff encoded on a link of any speed."""
    cost = CodecCost(3.8, 3e-3 / MIB)
    fast = 1000 * MIB  # bytes/s: well above int8's break-even (~100 MiB/s)
    assert not encoded_pull_pays(fast, cost)
    meter = LinkMeter()
    raw = 64 * MIB
    wire = raw / cost.ratio
    elapsed = wire / fast + raw * cost.s_per_byte  # what an encoded pull there takes
    meter.record(PEER, int(wire), int(raw / RAW_PER_TOKEN), elapsed)
    (sample,) = meter.estimates()
    assert encoded_pull_pays(sample.bytes_per_s, cost)  # taken plainly: stuck encoded
    assert link_rate(sample, RAW_PER_TOKEN, cost) == pytest.approx(fast, rel=1e-3)
    handoff = HandoffCodec("int8", 60.0)
    assert not handoff.encode(PEER, sample, RAW_PER_TOKEN, 4)  # raw: the link is fast
    assert link_rate(_link(5 * MIB), RAW_PER_TOKEN, cost) == 5 * MIB  # a raw sample: as is
