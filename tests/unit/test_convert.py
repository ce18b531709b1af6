"""The conversion layer between protobuf and pdserve's types: every message
round-trips losslessly, and what the types cannot hold is refused. (This is the
test of the protobuf edge itself, so it builds messages.)"""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core import types as t
from pdserve.core.handle import KVHandle, PushTarget
from pdserve.proto import convert
from pdserve.proto.pdserve.v1 import worker_pb2 as pb

HANDLE = KVHandle("p0", "r1-x", (3, 4), 4, "tcp", "127.0.0.1", 7001, "x-1", 123, pushed=True)


@pytest.mark.parametrize("value", [
    t.PhaseRequest("r1", "decode", (1, 2, 3), t.SamplingSpec(4, 0.5, 0.75, 5, 7, (2,), True),
                 kv_handle=HANDLE, push_target=PushTarget("h", 1, "t")),
    t.PhaseRequest("r2", "prefill", (9,), t.SamplingSpec(1)),
    t.PhaseRequest("r3", "decode", (1, 2, 3), t.SamplingSpec(
        4, presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
        min_tokens=2, logit_bias=((3, 1.5), (9, -100.0)), logprobs=0, prompt_logprobs=3,
        structured=t.StructuredOutput("regex", "[a-z]+"), min_p=0.125,
        cache_salt="tenant-a"),
        num_output_in_prompt=1),
])
def test_phase_request_round_trips(value: t.PhaseRequest) -> None:
    assert convert.phase_request_from_pb(convert.phase_request_to_pb(value)) == value


@pytest.mark.parametrize("finish", [None, "stop", "length", "abort", "error"])
def test_phase_output_round_trips(finish: t.FinishReason | None) -> None:
    out = t.PhaseOutput((5, 6), finish, HANDLE if finish else None, 2, 9)
    assert convert.phase_output_from_pb(convert.phase_output_to_pb(out)) == out


def test_phase_timing_round_trips() -> None:
    """The last output's timing (wall-clock stamps, durations), with and without a handle;
    an output without timing stays without."""
    timing = t.PhaseTiming(1_700_000_000_000_000_001, 1_700_000_000_500_000_000, 3, 4, 5)
    for handle in (HANDLE, None):
        out = t.PhaseOutput((5,), "length", handle, 2, 9, timing=timing)
        assert convert.phase_output_from_pb(convert.phase_output_to_pb(out)) == out
    assert not convert.phase_output_to_pb(t.PhaseOutput((5,))).HasField("timing")
    assert convert.phase_output_from_pb(pb.GenerateResponse(token_ids=[5])).timing is None


def test_worker_reports_round_trip() -> None:
    health = t.WorkerHealth(True, "prefill", "w0", "m", "float32", 128, 4096, "tcp", "abc",
                          "127.0.0.1", 51051, True)
    assert convert.health_from_pb(convert.health_to_pb(health)) == health
    on_store = dataclasses.replace(health, kv_store_id="0123456789abcdef", kv_store_ttl_s=0.1)
    assert convert.health_from_pb(convert.health_to_pb(on_store)) == on_store
    int8 = dataclasses.replace(health, kv_compression="int8")
    assert convert.health_from_pb(convert.health_to_pb(int8)) == int8
    older = convert.health_to_pb(health)  # a worker from before --kv-compression
    older.ClearField("kv_compression")
    assert convert.health_from_pb(older).kv_compression == "none"
    load = t.WorkerLoadReport(**{name: i + 1 for i, name in enumerate(
        t.WorkerLoadReport.__dataclass_fields__) if name not in ("kv_cache_usage", "kv_links")},
        kv_cache_usage=0.5, kv_links=(t.KvLink("10.0.0.7:7000", 1.5e9, 46080.0, 3, 0.25),
                                      t.KvLink("10.0.0.8:7000", 1.25e8, 46080.0, 1, 4.5)))
    assert convert.load_from_pb(convert.load_to_pb(load)) == load
    change = t.KvChange(3, True, (1, 2**64 - 1), (7,))
    assert convert.kv_change_from_pb(convert.kv_change_to_pb(change)) == change
    snap = t.KvSnapshot(4, (5, 6), 128, "w0")
    assert convert.kv_snapshot_from_pb(convert.kv_snapshot_to_pb(snap)) == snap


def test_an_unspecified_phase_or_role_is_refused() -> None:
    msg = convert.phase_request_to_pb(t.PhaseRequest("r1", "decode", (1,), t.SamplingSpec(2)))
    msg.phase = pb.PHASE_UNSPECIFIED
    with pytest.raises(ValueError, match="phase"):
        convert.phase_request_from_pb(msg)
    with pytest.raises(ValueError, match="role"):
        convert.health_from_pb(pb.HealthResponse(worker_id="w0"))


def test_every_enum_value_has_one_mapping() -> None:
    assert set(convert.PHASE_FROM_PB) == set(pb.Phase.values()) - {pb.PHASE_UNSPECIFIED}
    assert set(convert.ROLE_FROM_PB) == set(pb.Role.values()) - {pb.ROLE_UNSPECIFIED}
    assert set(convert.FINISH_FROM_PB) == set(pb.FinishReason.values())


def test_logprobs_round_trip_and_a_prompts_first_position_has_none() -> None:
    out = t.PhaseOutput((5, 6), logprobs=(t.TokenLogprobs(5, ((5, -0.5, 1), (7, -1.25, 2))),
                                          t.TokenLogprobs(6, ((6, float("-inf"), 9),))),
                        prompt_logprobs=(t.TokenLogprobs(1), t.TokenLogprobs(2, ((2, -3.0, 4),))))
    assert convert.phase_output_from_pb(convert.phase_output_to_pb(out)) == out


def test_a_decode_call_keeps_a_prompt_token_of_its_own() -> None:
    msg = convert.phase_request_to_pb(t.PhaseRequest("r", "decode", (1, 2), t.SamplingSpec(2)))
    msg.num_output_in_prompt = 2
    with pytest.raises(ValueError, match="num_output_in_prompt"):
        convert.phase_request_from_pb(msg)


def _response(ids: list[int], set_fields: tuple[str, ...]) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(token_ids=ids, num_cached_tokens=3, num_prompt_tokens=4)
    for name in set_fields:
        if name in ("kv_handle", "timing"):
            getattr(msg, name).SetInParent()
        elif name in ("logprobs", "prompt_logprobs"):
            getattr(msg, name).add()
        elif name == "finish_reason":
            msg.finish_reason = pb.FINISH_REASON_LENGTH
        else:
            setattr(msg, name, "v1")
    return msg


@pytest.mark.parametrize("ids", [[], [7], [7, 8, 9]])
@pytest.mark.parametrize("extra", [(), ("finish_reason",), ("kv_handle",), ("timing",),
                                   ("logprobs",), ("prompt_logprobs",), ("weight_version",),
                                   ("timing", "finish_reason")])
def test_only_an_output_of_ids_and_counts_is_plain(ids: list[int],
                                                    extra: tuple[str, ...]) -> None:
    """``plain_token_ids`` (what the session reader may offer a chunk sink) answers the
    ids exactly when nothing but them and the prompt counts is set, and what
    ``phase_output_from_pb`` makes of such an output is those ids alone."""
    msg = _response(ids, extra)
    plain = convert.plain_token_ids(msg)
    assert plain == (None if extra else tuple(ids))
    if plain is not None:
        out = convert.phase_output_from_pb(msg)
        assert out.token_ids == plain and out.finish_reason is None
        assert out.kv_handle is None and out.timing is None and not out.logprobs
