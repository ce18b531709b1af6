"""The one conversion layer between the generated protobuf messages and
pdserve's own types (``pdserve.core.types``). Only the two gRPC adapters (the
router's worker client and the workers' servicer) call it; everything else
works on the plain types. Every enum map is written here, once.

``*_from_pb`` raises ``ValueError`` on a message the types cannot hold (an
unspecified phase or role); the servicer maps that to ``INVALID_ARGUMENT``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, fields

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.handle import KVHandle, PoolSource, PushTarget
from pdserve.core.lora import LoraAdapter
from pdserve.core.types import (
    FinishReason,
    KvChange,
    KvLink,
    KvSnapshot,
    Phase,
    PhaseOutput,
    PhaseRequest,
    PhaseTiming,
    Role,
    RoleSwitch,
    SamplingSpec,
    StructuredKind,
    StructuredOutput,
    TokenLogprobs,
    WeightsCommitted,
    WeightsStaged,
    WorkerHealth,
    WorkerLoadReport,
)
from pdserve.proto.pdserve.v1 import worker_pb2 as pb

PHASE_TO_PB: dict[Phase, pb.Phase] = {"prefill": pb.PHASE_PREFILL, "decode": pb.PHASE_DECODE}
PHASE_FROM_PB: dict[pb.Phase, Phase] = {v: k for k, v in PHASE_TO_PB.items()}
ROLE_TO_PB: dict[Role, pb.Role] = {"prefill": pb.ROLE_PREFILL, "decode": pb.ROLE_DECODE}
ROLE_FROM_PB: dict[pb.Role, Role] = {v: k for k, v in ROLE_TO_PB.items()}
FINISH_TO_PB: dict[FinishReason | None, pb.FinishReason] = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
    "error": pb.FINISH_REASON_ERROR,
}
FINISH_FROM_PB: dict[pb.FinishReason, FinishReason | None] = {
    v: k for k, v in FINISH_TO_PB.items()}
_KIND = pb.StructuredOutput.Kind
STRUCTURED_TO_PB: dict[StructuredKind, pb.StructuredOutput.Kind] = {
    "json": _KIND.KIND_JSON, "json_object": _KIND.KIND_JSON_OBJECT, "regex": _KIND.KIND_REGEX,
    "choice": _KIND.KIND_CHOICE, "grammar": _KIND.KIND_GRAMMAR,
    "structural_tag": _KIND.KIND_STRUCTURAL_TAG,
}
STRUCTURED_FROM_PB = {v: k for k, v in STRUCTURED_TO_PB.items()}
_LOAD_FIELDS = tuple(f.name for f in fields(WorkerLoadReport))


def role_from_pb(value: pb.Role) -> Role:
    try:
        return ROLE_FROM_PB[value]
    except KeyError:
        raise ValueError("role must be ROLE_PREFILL or ROLE_DECODE") from None


def phase_from_pb(value: pb.Phase) -> Phase:
    try:
        return PHASE_FROM_PB[value]
    except KeyError:
        raise ValueError("phase must be PHASE_PREFILL or PHASE_DECODE") from None


# ---- sampling, handle, push target ---------------------------------------------------


def sampling_to_pb(spec: SamplingSpec) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=spec.max_tokens, temperature=spec.temperature, top_p=spec.top_p,
        top_k=spec.top_k, min_p=spec.min_p, stop_token_ids=spec.stop_token_ids,
        ignore_eos=spec.ignore_eos,
        presence_penalty=spec.presence_penalty, frequency_penalty=spec.frequency_penalty,
        repetition_penalty=spec.repetition_penalty, min_tokens=spec.min_tokens,
        logit_bias=[pb.LogitBias(token_id=t, bias=b) for t, b in spec.logit_bias])
    if spec.seed is not None:
        msg.seed = spec.seed
    if spec.logprobs is not None:
        msg.logprobs = spec.logprobs
    if spec.prompt_logprobs is not None:
        msg.prompt_logprobs = spec.prompt_logprobs
    if spec.structured is not None:
        msg.structured_output.CopyFrom(pb.StructuredOutput(
            kind=STRUCTURED_TO_PB[spec.structured.kind], spec=spec.structured.spec))
    if spec.cache_salt is not None:
        msg.cache_salt = spec.cache_salt
    if spec.lora_name is not None:
        msg.lora_name = spec.lora_name
    if spec.lora_path is not None:
        msg.lora_path = spec.lora_path
    return msg


def sampling_from_pb(msg: pb.SamplingParams) -> SamplingSpec:
    return SamplingSpec(
        max_tokens=msg.max_tokens, temperature=msg.temperature, top_p=msg.top_p or 1.0,
        top_k=max(msg.top_k, 0), min_p=msg.min_p,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids), ignore_eos=msg.ignore_eos,
        presence_penalty=msg.presence_penalty, frequency_penalty=msg.frequency_penalty,
        repetition_penalty=msg.repetition_penalty or 1.0, min_tokens=msg.min_tokens,
        logit_bias=tuple((b.token_id, b.bias) for b in msg.logit_bias),
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        structured=_structured_from_pb(msg),
        cache_salt=msg.cache_salt if msg.HasField("cache_salt") else None,
        lora_name=msg.lora_name if msg.HasField("lora_name") else None,
        lora_path=msg.lora_path if msg.HasField("lora_path") else None)


def _structured_from_pb(msg: pb.SamplingParams) -> StructuredOutput | None:
    if not msg.HasField("structured_output"):
        return None
    kind = STRUCTURED_FROM_PB.get(msg.structured_output.kind)
    if kind is None:
        raise ValueError("structured_output.kind must be set")
    return StructuredOutput(kind, msg.structured_output.spec)


def logprobs_to_pb(positions: tuple[TokenLogprobs, ...]) -> list[pb.TokenLogprobs]:
    return [pb.TokenLogprobs(token_id=p.token_id, entries=[
        pb.LogprobEntry(token_id=t, logprob=lp, rank=r) for t, lp, r in p.entries])
        for p in positions]


def logprobs_from_pb(positions: Iterable[pb.TokenLogprobs]) -> tuple[TokenLogprobs, ...]:
    return tuple(TokenLogprobs(p.token_id, tuple((e.token_id, e.logprob, e.rank)
                                                 for e in p.entries))
                 for p in positions)


def handle_to_pb(h: KVHandle) -> pb.KvHandle:
    return pb.KvHandle(
        engine_id=h.engine_id, remote_request_id=h.remote_request_id, block_ids=h.block_ids,
        num_tokens=h.num_tokens, transport=h.transport, host=h.host, port=h.port,
        transfer_id=h.transfer_id, lease_deadline_unix_ns=h.lease_deadline_unix_ns,
        pushed=h.pushed, weight_version=h.weight_version)


def handle_from_pb(h: pb.KvHandle) -> KVHandle:
    return KVHandle(
        engine_id=h.engine_id, remote_request_id=h.remote_request_id,
        block_ids=tuple(h.block_ids), num_tokens=h.num_tokens, transport=h.transport,
        host=h.host, port=h.port, transfer_id=h.transfer_id,
        lease_deadline_unix_ns=h.lease_deadline_unix_ns, pushed=h.pushed,
        weight_version=h.weight_version or DEFAULT_WEIGHT_VERSION)


# ---- Generate ------------------------------------------------------------------------


def phase_request_to_pb(req: PhaseRequest) -> pb.GenerateRequest:
    msg = pb.GenerateRequest(
        request_id=req.request_id, phase=PHASE_TO_PB[req.phase],
        prompt_token_ids=req.prompt_token_ids, sampling=sampling_to_pb(req.sampling),
        num_output_in_prompt=req.num_output_in_prompt, weight_version=req.weight_version)
    if req.kv_handle is not None:
        msg.kv_handle.CopyFrom(handle_to_pb(req.kv_handle))
    if req.push_target is not None:
        t = req.push_target
        msg.kv_push_target.CopyFrom(
            pb.KvPushTarget(host=t.host, port=t.port, transfer_id=t.transfer_id))
    if req.pool_source is not None:
        src = req.pool_source
        msg.kv_pool_source.CopyFrom(pb.KvPoolSource(
            host=src.host, port=src.port, num_blocks=src.num_blocks, worker_id=src.worker_id))
    return msg


def phase_request_from_pb(msg: pb.GenerateRequest) -> PhaseRequest:
    push = None
    if msg.HasField("kv_push_target"):
        t = msg.kv_push_target
        push = PushTarget(t.host, t.port, t.transfer_id)
    pool = None
    if msg.HasField("kv_pool_source"):
        src = msg.kv_pool_source
        pool = PoolSource(src.host, src.port, src.num_blocks, src.worker_id)
    return PhaseRequest(
        request_id=msg.request_id, phase=phase_from_pb(msg.phase),
        prompt_token_ids=tuple(msg.prompt_token_ids), sampling=sampling_from_pb(msg.sampling),
        kv_handle=handle_from_pb(msg.kv_handle) if msg.HasField("kv_handle") else None,
        push_target=push, pool_source=pool, num_output_in_prompt=_num_output_in_prompt(msg),
        weight_version=msg.weight_version)


def _num_output_in_prompt(msg: pb.GenerateRequest) -> int:
    if msg.num_output_in_prompt >= len(msg.prompt_token_ids) > 0:
        raise ValueError("num_output_in_prompt must leave at least one prompt token")
    return msg.num_output_in_prompt


def phase_output_to_pb(out: PhaseOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        token_ids=out.token_ids, finish_reason=FINISH_TO_PB[out.finish_reason],
        num_cached_tokens=out.num_cached_tokens, num_prompt_tokens=out.num_prompt_tokens,
        logprobs=logprobs_to_pb(out.logprobs),
        prompt_logprobs=logprobs_to_pb(out.prompt_logprobs),
        weight_version=out.weight_version)
    if out.kv_handle is not None:
        msg.kv_handle.CopyFrom(handle_to_pb(out.kv_handle))
    if out.timing is not None:
        msg.timing.CopyFrom(pb.PhaseTiming(**asdict(out.timing)))
    return msg


def phase_output_from_pb(msg: pb.GenerateResponse) -> PhaseOutput:
    """Per streamed chunk on the router: the optional fields are checked once each, and
    a chunk with neither a handle nor timing (every decode token but the last) takes
    the short path."""
    token_ids = tuple(msg.token_ids[:])  # from a slice: ``plain_token_ids`` says why
    finish = FINISH_FROM_PB.get(msg.finish_reason)
    if not _carries_more(msg):
        return PhaseOutput(token_ids, finish, None, msg.num_cached_tokens, msg.num_prompt_tokens)
    return PhaseOutput(
        token_ids=token_ids, finish_reason=finish,
        kv_handle=handle_from_pb(msg.kv_handle) if msg.HasField("kv_handle") else None,
        num_cached_tokens=msg.num_cached_tokens, num_prompt_tokens=msg.num_prompt_tokens,
        timing=timing_from_pb(msg.timing) if msg.HasField("timing") else None,
        logprobs=logprobs_from_pb(msg.logprobs),
        prompt_logprobs=logprobs_from_pb(msg.prompt_logprobs),
        weight_version=msg.weight_version)


def plain_token_ids(msg: pb.GenerateResponse) -> tuple[int, ...] | None:
    """The token ids of an output that carries nothing else (every decode token but the
    last: no finish reason, handle, timing, logprobs or weights version; its counts of
    cached and prompt tokens are only read on a call's first output); None for any other
    output. The session reader's one look at a message it may offer to a request's chunk
    sink (``workers/client.WorkerClient.generate``). The ids are copied from a slice:
    ``tuple`` of the repeated field itself iterates it in Python (1.8 against 0.3 µs)."""
    if msg.finish_reason or _carries_more(msg):
        return None
    return tuple(msg.token_ids[:])


def _carries_more(msg: pb.GenerateResponse) -> bool:
    """Whether an output carries more than its tokens, finish reason and counts: a KV
    handle, timing, logprobs or a weights version."""
    return bool(msg.HasField("kv_handle") or msg.HasField("timing") or msg.logprobs
                or msg.prompt_logprobs or msg.weight_version)


def timing_from_pb(msg: pb.PhaseTiming) -> PhaseTiming:
    return PhaseTiming(
        admitted_unix_ns=msg.admitted_unix_ns, first_token_unix_ns=msg.first_token_unix_ns,
        queue_ns=msg.queue_ns, compute_ns=msg.compute_ns, kv_load_ns=msg.kv_load_ns)


# ---- Health, GetLoad -----------------------------------------------------------------


def health_to_pb(h: WorkerHealth) -> pb.HealthResponse:
    return pb.HealthResponse(**dict(asdict(h), role=ROLE_TO_PB[h.role], loras=[
        pb.LoraAdapter(name=a.name, path=a.path) for a in h.loras]))


def health_from_pb(msg: pb.HealthResponse) -> WorkerHealth:
    """A worker that names no known role is an error (the router then refuses it)."""
    role = ROLE_FROM_PB.get(msg.role)
    if role is None:
        raise ValueError(f"worker {msg.worker_id!r} reports no known role")
    return WorkerHealth(
        ready=msg.ready, role=role, worker_id=msg.worker_id, model=msg.model, dtype=msg.dtype,
        block_size=msg.block_size, max_model_len=msg.max_model_len, transport=msg.transport,
        compatibility_hash=msg.compatibility_hash, kv_host=msg.kv_host, kv_port=msg.kv_port,
        kv_push=msg.kv_push, metrics_endpoint=msg.metrics_endpoint,
        prefill_chunk_tokens=msg.prefill_chunk_tokens,
        weight_version=msg.weight_version or DEFAULT_WEIGHT_VERSION,
        weights_path=msg.weights_path, kv_store_id=msg.kv_store_id,
        kv_store_ttl_s=msg.kv_store_ttl_s, kv_compression=msg.kv_compression or "none",
        loras=_loras_from_pb(msg))


def _loras_from_pb(msg: pb.HealthResponse) -> tuple[LoraAdapter, ...]:
    """The adapters a worker names; one that names none validly is an error."""
    return tuple(LoraAdapter(a.name, a.path) for a in msg.loras)


def load_to_pb(load: WorkerLoadReport) -> pb.GetLoadResponse:
    return pb.GetLoadResponse(**asdict(load))


def load_from_pb(msg: pb.GetLoadResponse) -> WorkerLoadReport:
    return WorkerLoadReport(**{name: getattr(msg, name) for name in _LOAD_FIELDS
                               if name != "kv_links"},
                            kv_links=tuple(KvLink(link.peer, link.bytes_per_s,
                                                  link.bytes_per_token, link.samples,
                                                  link.age_s) for link in msg.kv_links))


# ---- KV events -----------------------------------------------------------------------


def kv_change_to_pb(change: KvChange) -> pb.KvEventBatch:
    return pb.KvEventBatch(seq=change.seq, cleared=change.cleared, stored=change.stored,
                           removed=change.removed)


def kv_change_from_pb(msg: pb.KvEventBatch) -> KvChange:
    return KvChange(seq=msg.seq, cleared=msg.cleared, stored=tuple(msg.stored),
                    removed=tuple(msg.removed))


def kv_snapshot_to_pb(snap: KvSnapshot) -> pb.KvSnapshot:
    return pb.KvSnapshot(seq=snap.seq, block_hashes=snap.block_hashes,
                         block_size=snap.block_size, worker_id=snap.worker_id)


def kv_snapshot_from_pb(msg: pb.KvSnapshot) -> KvSnapshot:
    return KvSnapshot(seq=msg.seq, block_hashes=tuple(msg.block_hashes),
                      block_size=msg.block_size, worker_id=msg.worker_id)


# ---- role switch ---------------------------------------------------------------------


def set_role_to_pb(role: Role, drain_timeout_s: float) -> pb.SetRoleRequest:
    return pb.SetRoleRequest(role=ROLE_TO_PB[role],
                             drain_timeout_ns=int(max(drain_timeout_s, 0.0) * 1e9))


def set_role_from_pb(msg: pb.SetRoleRequest) -> tuple[Role, float]:
    """(role, drain timeout in seconds); raises ``ValueError`` on no known role."""
    return role_from_pb(msg.role), msg.drain_timeout_ns / 1e9


def role_switch_to_pb(result: RoleSwitch) -> pb.SetRoleResponse:
    return pb.SetRoleResponse(**dict(asdict(result), role=ROLE_TO_PB[result.role]))


def role_switch_from_pb(msg: pb.SetRoleResponse) -> RoleSwitch:
    return RoleSwitch(role=role_from_pb(msg.role), changed=msg.changed,
                      num_aborted=msg.num_aborted,
                      num_leases_released=msg.num_leases_released, switch_ns=msg.switch_ns)


# ---- weights -------------------------------------------------------------------------


def staged_from_pb(msg: pb.StageWeightsResponse) -> WeightsStaged:
    return WeightsStaged(num_tensors=msg.num_tensors, num_bytes=msg.num_bytes,
                         stage_ns=msg.stage_ns)


def committed_from_pb(msg: pb.CommitWeightsResponse) -> WeightsCommitted:
    return WeightsCommitted(weight_version=msg.weight_version, num_aborted=msg.num_aborted,
                            commit_ns=msg.commit_ns)
