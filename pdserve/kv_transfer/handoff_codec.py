"""Whether a P->D pull moves its blocks encoded (``--kv-compression``): the rule, the
codec costs it is made with, and the peers that refused an encoding.

Per raw byte, on a link of ``L`` bytes/s, with a codec that divides the bytes by
``ratio`` and costs ``c`` seconds (encode on the prefill plus decode here)::

    raw     = 1 / L
    encoded = 1 / (ratio * L) + c          pays  <=>  L < (1 - 1 / ratio) / c

The model is serial (a block is encoded, sent, then decoded); the codec's stream
overlaps them somewhat, so it errs towards raw. ``L`` is the ``LinkMeter`` estimate of
that peer; with none, the pull goes raw, and so measures the path.

``ratio`` and ``c`` are learned per worker (one codec each) from its encoded pulls, as
moving averages: the ratio from the raw and wire bytes, ``c`` from the prefill's encode
time (its trailer's ``encode_ns``) plus the decode time measured here (both wall time:
what the pull waited for). Before the first sample, conservative priors (a ratio at or
below, a cost at or above every *wall* time measured, since the learned cost is wall
time too) from ``bench/results/kv-compression/epyc-{1,2}.jsonl`` ("real" rows: the
default model's KV, blocks of 128 tokens, one core):

- lossless: float32 ratio 1.194-1.195, encode + decode 5.8-8.7 ms/MiB wall (4.2-4.3 of
  CPU); bfloat16 ratio 1.475, 8.9-21.1 ms/MiB wall. Priors: 1.15 and 9 ms/MiB (4-byte
  elements: it pays below ~14.5 MiB/s), 1.4 and 21 ms/MiB (2-byte: ~13.6 MiB/s). On a
  1-byte cache it does not pay.
- int8 / fp8: float32 ratio 3.765-3.996, bfloat16 1.882-1.998 (one byte a value plus a
  float32 scale per ``head_dim`` values); 0.5-7.0 ms/MiB wall. Priors: 0.9 x the element
  size and 7 ms/MiB (float32: pays below ~103 MiB/s).

What the meter holds: an encoded pull is recorded as its *wire* bytes over the time it
took (from the peer's first reply to the trailer, codec time included), so the meter's
``bytes_per_token`` is what a token weighed on the wire and the router's price of a
handoff (tokens x bytes_per_token / rate) is the time such a pull takes. That rate is
the link's plus the codec's (per wire byte: ``1 / L + c * raw / wire``); taken as
``L`` it would keep every later pull encoded (for ``ratio >= 2`` on any link). So
``link_rate`` reads it back: where the estimate's ``bytes_per_token`` is below the raw
one (its latest sample was encoded), it removes the codec's share of that sample,
``1 / L = s_per_wire_byte - c * raw / wire``; a link whose time that leaves at or
below zero is taken as fast (raw: the next pull measures it plainly). The meter's
average mixes both kinds across a switch: the first pull after one is decided on a
blend, the next ones on the new kind's samples.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.kv_transfer.links import LinkEstimate

# What a transport counts of its encoded P->D pulls (GetLoad's kv_encoded_*).
STATS = ("encoded_pulls", "encoded_bytes_saved", "encoded_pull_refusals")
MIB = float(1 << 20)
NEW_SAMPLE_WEIGHT = 0.5
MIN_SAMPLE_BYTES = 1 << 20  # smaller pulls: round trips and headers, not the codec


@dataclass(frozen=True)
class CodecCost:
    """What one codec does to a pull: bytes divided by ``ratio``, ``s_per_byte``
    seconds (encode + decode) per raw byte; ``samples`` 0 for a prior."""

    ratio: float
    s_per_byte: float
    samples: int = 0


def prior_cost(codec: str, element_size: int) -> CodecCost:
    """The conservative guess before any encoded pull (see the module docstring)."""
    if codec == "lossless":
        if element_size >= 4:
            return CodecCost(1.15, 9e-3 / MIB)
        return CodecCost(1.4 if element_size == 2 else 1.0, 21e-3 / MIB)
    if codec in ("int8", "fp8"):
        return CodecCost(0.9 * element_size, 7e-3 / MIB)
    raise ValueError(f"no handoff encoding for KV compression {codec!r}; valid: "
                     "lossless, int8, fp8")


def encoded_pull_pays(link_bytes_per_s: float | None, cost: CodecCost) -> bool:
    """The rule: True when an encoded pull is estimated faster than a raw one over a
    link of ``link_bytes_per_s`` (None: unmeasured, so raw)."""
    if link_bytes_per_s is None or not link_bytes_per_s > 0 or cost.ratio <= 1:
        return False
    if cost.s_per_byte <= 0:  # a codec that costs nothing measurable: fewer bytes win
        return True
    return link_bytes_per_s < (1 - 1 / cost.ratio) / cost.s_per_byte


def link_rate(estimate: LinkEstimate | None, raw_bytes_per_token: float,
              cost: CodecCost) -> float | None:
    """The link's own bytes/s from the meter's ``estimate`` of a peer (None: none),
    less the codec's time where its latest sample was an encoded pull."""
    if estimate is None or not estimate.bytes_per_s > 0:
        return None
    per_wire_byte = 1.0 / estimate.bytes_per_s
    if 0 < estimate.bytes_per_token < raw_bytes_per_token:
        per_wire_byte -= cost.s_per_byte * raw_bytes_per_token / estimate.bytes_per_token
    return 1.0 / per_wire_byte if per_wire_byte > 0 else float("inf")


class HandoffCodec:
    """One worker's handoff encoding: its codec's learned cost, and the peers that
    refused the encoding (pulled raw until ``refusal_s`` has passed). Thread-safe:
    the connector's pull threads decide and record at once."""

    def __init__(self, codec: str, refusal_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        prior_cost(codec, 4)  # an unknown name fails here, not at the first pull
        self.codec = codec
        self._refusal_s = refusal_s
        self._clock = clock
        self._lock = threading.Lock()
        self._learned: CodecCost | None = None
        self._refused: dict[str, float] = {}  # peer -> when it refused

    def cost(self, element_size: int) -> CodecCost:
        """The learned cost, or the prior for ``element_size`` before any sample."""
        with self._lock:
            learned = self._learned
        return learned if learned is not None else prior_cost(self.codec, element_size)

    def encode(self, peer: str, estimate: LinkEstimate | None, raw_bytes_per_token: float,
               element_size: int) -> bool:
        """Whether the next pull from ``peer`` asks for encoded blocks."""
        with self._lock:
            refused = self._refused.get(peer)
            if refused is not None and self._clock() - refused > self._refusal_s:
                del self._refused[peer]
                refused = None
        if refused is not None:
            return False
        cost = self.cost(element_size)
        return encoded_pull_pays(link_rate(estimate, raw_bytes_per_token, cost), cost)

    def refused_by(self, peer: str) -> None:
        """``peer`` refused the encoding (another ``--kv-compression``): pull raw."""
        with self._lock:
            self._refused[peer] = self._clock()

    def record(self, raw_bytes: int, wire_bytes: int, codec_s: float) -> None:
        """One encoded pull: ``raw_bytes`` moved as ``wire_bytes`` for ``codec_s``
        seconds of encoding and decoding."""
        if raw_bytes < MIN_SAMPLE_BYTES or wire_bytes <= 0 or codec_s < 0:
            return
        ratio, per_byte = raw_bytes / wire_bytes, codec_s / raw_bytes
        with self._lock:
            old = self._learned
            if old is not None:
                w = NEW_SAMPLE_WEIGHT
                ratio = w * ratio + (1 - w) * old.ratio
                per_byte = w * per_byte + (1 - w) * old.s_per_byte
            self._learned = CodecCost(ratio, per_byte, 1 if old is None else old.samples + 1)
