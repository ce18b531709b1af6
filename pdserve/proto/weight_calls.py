"""``EngineWeightCallRequest`` <-> ``pdserve.core.weight_calls``: the typed weight calls
on the wire (a ``oneof`` of one message per vLLM call). Both directions are exact: a
field unset on one side is unset (``None``) on the other."""

from __future__ import annotations

from typing import Any

from pdserve.core.weight_calls import (
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

_INIT_FIELDS = tuple(pb.TransferInitInfo.DESCRIPTOR.fields_by_name)


def weight_call_to_pb(call: WeightCall) -> pb.EngineWeightCallRequest:
    if isinstance(call, InitWeightTransferEngine):
        info = {k: v for k, v in vars(call.init_info).items() if v is not None}
        return pb.EngineWeightCallRequest(init_weight_transfer_engine=pb.InitWeightTransferEngine(
            init_info=pb.TransferInitInfo(**info)))
    if isinstance(call, UpdateWeights):
        u = call.update_info
        return pb.EngineWeightCallRequest(update_weights=pb.UpdateWeights(
            update_info=pb.TransferUpdateInfo(
                names=u.names, dtype_names=u.dtype_names,
                shapes=[pb.TensorShape(dims=s) for s in u.shapes],
                tensor_sizes=u.tensor_sizes or ())))
    if isinstance(call, FinishWeightUpdate):
        return pb.EngineWeightCallRequest(finish_weight_update=pb.FinishWeightUpdate(
            weight_version=call.weight_version))
    if isinstance(call, UpdateWeightVersion):
        return pb.EngineWeightCallRequest(update_weight_version=pb.UpdateWeightVersion(
            new_version=call.new_version))
    if isinstance(call, StartWeightUpdate):
        return pb.EngineWeightCallRequest(start_weight_update=pb.StartWeightUpdate())
    return pb.EngineWeightCallRequest(
        shutdown_weight_transfer_engine=pb.ShutdownWeightTransferEngine())


def weight_call_from_pb(msg: pb.EngineWeightCallRequest) -> WeightCall:
    """The call ``msg`` carries; ``ValueError`` when it carries none (or an invalid one)."""
    case = msg.WhichOneof("call")
    if case == "init_weight_transfer_engine":
        init = msg.init_weight_transfer_engine.init_info
        info: dict[str, Any] = {f: getattr(init, f) for f in _INIT_FIELDS if init.HasField(f)}
        return InitWeightTransferEngine(TransferInitInfo(**info))
    if case == "update_weights":
        u = msg.update_weights.update_info
        return UpdateWeights(TransferUpdateInfo(
            names=tuple(u.names), dtype_names=tuple(u.dtype_names),
            shapes=tuple(tuple(s.dims) for s in u.shapes),
            tensor_sizes=tuple(u.tensor_sizes) if u.tensor_sizes else None))
    if case == "finish_weight_update":
        finish = msg.finish_weight_update
        return FinishWeightUpdate(
            finish.weight_version if finish.HasField("weight_version") else None)
    if case == "update_weight_version":
        return UpdateWeightVersion(msg.update_weight_version.new_version)
    if case == "start_weight_update":
        return StartWeightUpdate()
    if case == "shutdown_weight_transfer_engine":
        return ShutdownWeightTransferEngine()
    raise ValueError("EngineWeightCall carries no call this worker knows (the oneof "
                     "`call` is empty, or set to a case newer than this worker)")
