"""``pdserve.proto.weight_calls``: every typed weight call survives the wire exactly
(``weight_call_from_pb(weight_call_to_pb(c)) == c``, an unset field stays unset), each
as its own case of ``EngineWeightCallRequest``'s oneof; a message with no case is a
``ValueError`` (INVALID_ARGUMENT at the servicer)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.core.weight_calls import (
    WEIGHT_CALLS,
    FinishWeightUpdate,
    InitWeightTransferEngine,
    ShutdownWeightTransferEngine,
    StartWeightUpdate,
    TransferInitInfo,
    TransferUpdateInfo,
    UpdateWeights,
    UpdateWeightVersion,
    WeightCall,
)
from pdserve.proto.pdserve.v1 import worker_pb2 as pb
from pdserve.proto.weight_calls import weight_call_from_pb, weight_call_to_pb

U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=12)

init_infos = st.builds(
    TransferInitInfo, master_address=st.none() | TEXT, master_port=st.none() | U32,
    rank_offset=st.none() | U32, world_size=st.none() | U32,
    nccl_unique_id_b64=st.none() | TEXT, packed=st.none() | st.booleans(),
    packed_buffer_size_bytes=st.none() | U64, packed_num_buffers=st.none() | U32)


@st.composite
def update_infos(draw: st.DrawFn) -> TransferUpdateInfo:
    n = draw(st.integers(0, 4))
    sizes = draw(st.none() | st.lists(U64, min_size=1, max_size=4))
    return TransferUpdateInfo(
        names=tuple(draw(st.lists(TEXT, min_size=n, max_size=n))),
        dtype_names=tuple(draw(st.lists(TEXT, min_size=n, max_size=n))),
        shapes=tuple(tuple(s) for s in draw(st.lists(st.lists(U64, max_size=3), min_size=n,
                                                      max_size=n))),
        tensor_sizes=None if sizes is None else tuple(sizes))


calls: st.SearchStrategy[WeightCall] = st.one_of(
    st.builds(InitWeightTransferEngine, init_infos), st.just(StartWeightUpdate()),
    st.builds(UpdateWeights, update_infos()),
    st.builds(FinishWeightUpdate, st.none() | TEXT),
    st.builds(UpdateWeightVersion, TEXT.filter(bool)),
    st.just(ShutdownWeightTransferEngine()))


@given(calls)
def test_every_call_survives_the_wire_exactly(call: WeightCall) -> None:
    msg = weight_call_to_pb(call)
    assert msg.WhichOneof("call") == call.name
    assert weight_call_from_pb(pb.EngineWeightCallRequest.FromString(
        msg.SerializeToString())) == call


def test_each_call_has_its_own_case_of_the_oneof() -> None:
    cases = {f.name for f in pb.EngineWeightCallRequest.DESCRIPTOR.oneofs_by_name["call"].fields}
    assert cases == {call.name for call in WEIGHT_CALLS}


def test_an_empty_request_is_refused() -> None:
    with pytest.raises(ValueError, match="no call"):
        weight_call_from_pb(pb.EngineWeightCallRequest())
