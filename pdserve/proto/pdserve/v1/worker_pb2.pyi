from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Phase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PHASE_UNSPECIFIED: _ClassVar[Phase]
    PHASE_PREFILL: _ClassVar[Phase]
    PHASE_DECODE: _ClassVar[Phase]

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
PHASE_UNSPECIFIED: Phase
PHASE_PREFILL: Phase
PHASE_DECODE: Phase
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "logprobs", "prompt_logprobs", "structured_output", "min_p", "cache_salt", "lora_name", "lora_path")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.RepeatedCompositeFieldContainer[LogitBias]
    logprobs: int
    prompt_logprobs: int
    structured_output: StructuredOutput
    min_p: float
    cache_salt: str
    lora_name: str
    lora_path: str
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Iterable[_Union[LogitBias, _Mapping]]] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., structured_output: _Optional[_Union[StructuredOutput, _Mapping]] = ..., min_p: _Optional[float] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LogitBias(_message.Message):
    __slots__ = ("token_id", "bias")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    BIAS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    bias: float
    def __init__(self, token_id: _Optional[int] = ..., bias: _Optional[float] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "spec")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KIND_UNSPECIFIED: _ClassVar[StructuredOutput.Kind]
        KIND_JSON: _ClassVar[StructuredOutput.Kind]
        KIND_JSON_OBJECT: _ClassVar[StructuredOutput.Kind]
        KIND_REGEX: _ClassVar[StructuredOutput.Kind]
        KIND_CHOICE: _ClassVar[StructuredOutput.Kind]
        KIND_GRAMMAR: _ClassVar[StructuredOutput.Kind]
        KIND_STRUCTURAL_TAG: _ClassVar[StructuredOutput.Kind]
    KIND_UNSPECIFIED: StructuredOutput.Kind
    KIND_JSON: StructuredOutput.Kind
    KIND_JSON_OBJECT: StructuredOutput.Kind
    KIND_REGEX: StructuredOutput.Kind
    KIND_CHOICE: StructuredOutput.Kind
    KIND_GRAMMAR: StructuredOutput.Kind
    KIND_STRUCTURAL_TAG: StructuredOutput.Kind
    KIND_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    kind: StructuredOutput.Kind
    spec: str
    def __init__(self, kind: _Optional[_Union[StructuredOutput.Kind, str]] = ..., spec: _Optional[str] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "entries")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    entries: _containers.RepeatedCompositeFieldContainer[LogprobEntry]
    def __init__(self, token_id: _Optional[int] = ..., entries: _Optional[_Iterable[_Union[LogprobEntry, _Mapping]]] = ...) -> None: ...

class LogprobEntry(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class KvHandle(_message.Message):
    __slots__ = ("engine_id", "remote_request_id", "block_ids", "num_tokens", "transport", "host", "port", "transfer_id", "lease_deadline_unix_ns", "pushed", "weight_version")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    REMOTE_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_DEADLINE_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    engine_id: str
    remote_request_id: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    transport: str
    host: str
    port: int
    transfer_id: str
    lease_deadline_unix_ns: int
    pushed: bool
    weight_version: str
    def __init__(self, engine_id: _Optional[str] = ..., remote_request_id: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., transport: _Optional[str] = ..., host: _Optional[str] = ..., port: _Optional[int] = ..., transfer_id: _Optional[str] = ..., lease_deadline_unix_ns: _Optional[int] = ..., pushed: _Optional[bool] = ..., weight_version: _Optional[str] = ...) -> None: ...

class KvPushTarget(_message.Message):
    __slots__ = ("host", "port", "transfer_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    transfer_id: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., transfer_id: _Optional[str] = ...) -> None: ...

class KvPoolSource(_message.Message):
    __slots__ = ("host", "port", "num_blocks", "worker_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    port: int
    num_blocks: int
    worker_id: str
    def __init__(self, host: _Optional[str] = ..., port: _Optional[int] = ..., num_blocks: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "phase", "prompt_token_ids", "sampling", "kv_handle", "kv_push_target", "kv_pool_source", "num_output_in_prompt", "weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_TARGET_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_OUTPUT_IN_PROMPT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    phase: Phase
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    kv_handle: KvHandle
    kv_push_target: KvPushTarget
    kv_pool_source: KvPoolSource
    num_output_in_prompt: int
    weight_version: str
    def __init__(self, request_id: _Optional[str] = ..., phase: _Optional[_Union[Phase, str]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., kv_push_target: _Optional[_Union[KvPushTarget, _Mapping]] = ..., kv_pool_source: _Optional[_Union[KvPoolSource, _Mapping]] = ..., num_output_in_prompt: _Optional[int] = ..., weight_version: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "kv_handle", "num_cached_tokens", "num_prompt_tokens", "timing", "logprobs", "prompt_logprobs", "weight_version")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    KV_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: FinishReason
    kv_handle: KvHandle
    num_cached_tokens: int
    num_prompt_tokens: int
    timing: PhaseTiming
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    weight_version: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., kv_handle: _Optional[_Union[KvHandle, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., num_prompt_tokens: _Optional[int] = ..., timing: _Optional[_Union[PhaseTiming, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., weight_version: _Optional[str] = ...) -> None: ...

class PhaseTiming(_message.Message):
    __slots__ = ("admitted_unix_ns", "first_token_unix_ns", "queue_ns", "compute_ns", "kv_load_ns")
    ADMITTED_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_UNIX_NS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_NS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_NS_FIELD_NUMBER: _ClassVar[int]
    admitted_unix_ns: int
    first_token_unix_ns: int
    queue_ns: int
    compute_ns: int
    kv_load_ns: int
    def __init__(self, admitted_unix_ns: _Optional[int] = ..., first_token_unix_ns: _Optional[int] = ..., queue_ns: _Optional[int] = ..., compute_ns: _Optional[int] = ..., kv_load_ns: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("stream_id", "start", "cancel", "timeout_ns", "plain_columns")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_NS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_COLUMNS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    start: GenerateRequest
    cancel: bool
    timeout_ns: int
    plain_columns: bool
    def __init__(self, stream_id: _Optional[int] = ..., start: _Optional[_Union[GenerateRequest, _Mapping]] = ..., cancel: _Optional[bool] = ..., timeout_ns: _Optional[int] = ..., plain_columns: _Optional[bool] = ...) -> None: ...

class SessionOutput(_message.Message):
    __slots__ = ("stream_id", "response", "end", "status_code", "status_details")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STATUS_DETAILS_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    response: GenerateResponse
    end: bool
    status_code: int
    status_details: str
    def __init__(self, stream_id: _Optional[int] = ..., response: _Optional[_Union[GenerateResponse, _Mapping]] = ..., end: _Optional[bool] = ..., status_code: _Optional[int] = ..., status_details: _Optional[str] = ...) -> None: ...

class SessionBatch(_message.Message):
    __slots__ = ("outputs", "plain_stream_ids", "plain_token_ids")
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_STREAM_IDS_FIELD_NUMBER: _ClassVar[int]
    PLAIN_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    outputs: _containers.RepeatedCompositeFieldContainer[SessionOutput]
    plain_stream_ids: _containers.RepeatedScalarFieldContainer[int]
    plain_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, outputs: _Optional[_Iterable[_Union[SessionOutput, _Mapping]]] = ..., plain_stream_ids: _Optional[_Iterable[int]] = ..., plain_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class HealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class HealthResponse(_message.Message):
    __slots__ = ("ready", "role", "worker_id", "model", "dtype", "block_size", "max_model_len", "transport", "compatibility_hash", "kv_host", "kv_port", "kv_push", "metrics_endpoint", "prefill_chunk_tokens", "session", "weight_version", "weights_path", "kv_store_id", "kv_store_ttl_s", "kv_compression", "loras")
    READY_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    COMPATIBILITY_HASH_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_FIELD_NUMBER: _ClassVar[int]
    KV_PORT_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHUNK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_PATH_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_TTL_S_FIELD_NUMBER: _ClassVar[int]
    KV_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    LORAS_FIELD_NUMBER: _ClassVar[int]
    ready: bool
    role: Role
    worker_id: str
    model: str
    dtype: str
    block_size: int
    max_model_len: int
    transport: str
    compatibility_hash: str
    kv_host: str
    kv_port: int
    kv_push: bool
    metrics_endpoint: str
    prefill_chunk_tokens: int
    session: bool
    weight_version: str
    weights_path: str
    kv_store_id: str
    kv_store_ttl_s: float
    kv_compression: str
    loras: _containers.RepeatedCompositeFieldContainer[LoraAdapter]
    def __init__(self, ready: _Optional[bool] = ..., role: _Optional[_Union[Role, str]] = ..., worker_id: _Optional[str] = ..., model: _Optional[str] = ..., dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., transport: _Optional[str] = ..., compatibility_hash: _Optional[str] = ..., kv_host: _Optional[str] = ..., kv_port: _Optional[int] = ..., kv_push: _Optional[bool] = ..., metrics_endpoint: _Optional[str] = ..., prefill_chunk_tokens: _Optional[int] = ..., session: _Optional[bool] = ..., weight_version: _Optional[str] = ..., weights_path: _Optional[str] = ..., kv_store_id: _Optional[str] = ..., kv_store_ttl_s: _Optional[float] = ..., kv_compression: _Optional[str] = ..., loras: _Optional[_Iterable[_Union[LoraAdapter, _Mapping]]] = ...) -> None: ...

class LoraAdapter(_message.Message):
    __slots__ = ("name", "path")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("num_running_reqs", "num_waiting_reqs", "kv_cache_usage", "num_pending_transfers", "prompt_tokens_computed", "prompt_tokens_local_cache_hit", "prompt_tokens_external", "kv_bytes_sent", "kv_bytes_received", "kv_transfers_completed", "kv_transfers_failed", "kv_transfer_time_ns", "num_inflight_reqs", "kv_leases_expired", "kv_loads", "kv_load_time_ns", "kv_push_loads", "kv_push_fallbacks", "kv_layers_pushed", "kv_pushes_failed", "kv_leases_held", "kv_push_inbox_bytes", "num_cached_blocks", "step_base_us", "step_per_seq_us", "step_per_token_ns", "step_decode_samples", "step_prefill_samples", "kv_tier_loads", "kv_tier_load_blocks", "kv_tier_load_time_ns", "kv_tier_load_failures", "kv_tier_saves", "kv_tier_save_blocks", "kv_tier_save_failures", "kv_disk_loads", "kv_disk_load_blocks", "kv_disk_load_time_ns", "kv_disk_load_failures", "kv_disk_saves", "kv_disk_save_blocks", "kv_disk_save_failures", "kv_pool_loads", "kv_pool_load_blocks", "kv_pool_load_time_ns", "kv_pool_load_failures", "kv_pool_serves", "kv_pool_serve_blocks", "kv_pool_serve_failures", "kv_tier_load_bytes", "kv_disk_load_bytes", "kv_pool_load_bytes", "kv_tier_miss_blocks", "kv_tier_evictions", "kv_disk_evictions", "kv_store_lookups", "kv_store_hit_blocks", "kv_store_lookup_errors", "kv_store_lookup_timeouts", "kv_store_lookups_skipped", "kv_store_fetch_chosen", "kv_store_compute_chosen", "kv_store_loads", "kv_store_load_blocks", "kv_store_load_bytes", "kv_store_load_time_ns", "kv_store_load_failures", "kv_store_load_missing", "kv_store_bad_blocks", "kv_store_timeouts", "kv_store_save_blocks", "kv_store_save_dropped", "kv_store_put_written", "kv_store_put_failures", "kv_store_not_admitted", "kv_store_bad_deleted", "kv_pool_load_refusals", "kv_pool_serve_refusals", "kv_links", "kv_encoded_pulls", "kv_encoded_bytes_saved", "kv_encoded_pull_refusals")
    NUM_RUNNING_REQS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_TRANSFERS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_LOCAL_CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_EXTERNAL_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_COMPLETED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    NUM_INFLIGHT_REQS_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_EXPIRED_FIELD_NUMBER: _ClassVar[int]
    KV_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_LOAD_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    KV_LAYERS_PUSHED_FIELD_NUMBER: _ClassVar[int]
    KV_PUSHES_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    KV_PUSH_INBOX_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STEP_BASE_US_FIELD_NUMBER: _ClassVar[int]
    STEP_PER_SEQ_US_FIELD_NUMBER: _ClassVar[int]
    STEP_PER_TOKEN_NS_FIELD_NUMBER: _ClassVar[int]
    STEP_DECODE_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    STEP_PREFILL_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_SAVES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_SAVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_LOAD_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_SAVES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_SAVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SERVES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SERVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SERVE_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TIER_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_DISK_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOOKUP_ERRORS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOOKUP_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOOKUPS_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_FETCH_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_COMPUTE_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_TIME_NS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_LOAD_MISSING_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BAD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SAVE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_SAVE_DROPPED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_PUT_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_PUT_FAILURES_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    KV_STORE_BAD_DELETED_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_LOAD_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    KV_POOL_SERVE_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    KV_LINKS_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODED_PULLS_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODED_BYTES_SAVED_FIELD_NUMBER: _ClassVar[int]
    KV_ENCODED_PULL_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_pending_transfers: int
    prompt_tokens_computed: int
    prompt_tokens_local_cache_hit: int
    prompt_tokens_external: int
    kv_bytes_sent: int
    kv_bytes_received: int
    kv_transfers_completed: int
    kv_transfers_failed: int
    kv_transfer_time_ns: int
    num_inflight_reqs: int
    kv_leases_expired: int
    kv_loads: int
    kv_load_time_ns: int
    kv_push_loads: int
    kv_push_fallbacks: int
    kv_layers_pushed: int
    kv_pushes_failed: int
    kv_leases_held: int
    kv_push_inbox_bytes: int
    num_cached_blocks: int
    step_base_us: int
    step_per_seq_us: int
    step_per_token_ns: int
    step_decode_samples: int
    step_prefill_samples: int
    kv_tier_loads: int
    kv_tier_load_blocks: int
    kv_tier_load_time_ns: int
    kv_tier_load_failures: int
    kv_tier_saves: int
    kv_tier_save_blocks: int
    kv_tier_save_failures: int
    kv_disk_loads: int
    kv_disk_load_blocks: int
    kv_disk_load_time_ns: int
    kv_disk_load_failures: int
    kv_disk_saves: int
    kv_disk_save_blocks: int
    kv_disk_save_failures: int
    kv_pool_loads: int
    kv_pool_load_blocks: int
    kv_pool_load_time_ns: int
    kv_pool_load_failures: int
    kv_pool_serves: int
    kv_pool_serve_blocks: int
    kv_pool_serve_failures: int
    kv_tier_load_bytes: int
    kv_disk_load_bytes: int
    kv_pool_load_bytes: int
    kv_tier_miss_blocks: int
    kv_tier_evictions: int
    kv_disk_evictions: int
    kv_store_lookups: int
    kv_store_hit_blocks: int
    kv_store_lookup_errors: int
    kv_store_lookup_timeouts: int
    kv_store_lookups_skipped: int
    kv_store_fetch_chosen: int
    kv_store_compute_chosen: int
    kv_store_loads: int
    kv_store_load_blocks: int
    kv_store_load_bytes: int
    kv_store_load_time_ns: int
    kv_store_load_failures: int
    kv_store_load_missing: int
    kv_store_bad_blocks: int
    kv_store_timeouts: int
    kv_store_save_blocks: int
    kv_store_save_dropped: int
    kv_store_put_written: int
    kv_store_put_failures: int
    kv_store_not_admitted: int
    kv_store_bad_deleted: int
    kv_pool_load_refusals: int
    kv_pool_serve_refusals: int
    kv_links: _containers.RepeatedCompositeFieldContainer[KvLink]
    kv_encoded_pulls: int
    kv_encoded_bytes_saved: int
    kv_encoded_pull_refusals: int
    def __init__(self, num_running_reqs: _Optional[int] = ..., num_waiting_reqs: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., num_pending_transfers: _Optional[int] = ..., prompt_tokens_computed: _Optional[int] = ..., prompt_tokens_local_cache_hit: _Optional[int] = ..., prompt_tokens_external: _Optional[int] = ..., kv_bytes_sent: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., kv_transfers_completed: _Optional[int] = ..., kv_transfers_failed: _Optional[int] = ..., kv_transfer_time_ns: _Optional[int] = ..., num_inflight_reqs: _Optional[int] = ..., kv_leases_expired: _Optional[int] = ..., kv_loads: _Optional[int] = ..., kv_load_time_ns: _Optional[int] = ..., kv_push_loads: _Optional[int] = ..., kv_push_fallbacks: _Optional[int] = ..., kv_layers_pushed: _Optional[int] = ..., kv_pushes_failed: _Optional[int] = ..., kv_leases_held: _Optional[int] = ..., kv_push_inbox_bytes: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., step_base_us: _Optional[int] = ..., step_per_seq_us: _Optional[int] = ..., step_per_token_ns: _Optional[int] = ..., step_decode_samples: _Optional[int] = ..., step_prefill_samples: _Optional[int] = ..., kv_tier_loads: _Optional[int] = ..., kv_tier_load_blocks: _Optional[int] = ..., kv_tier_load_time_ns: _Optional[int] = ..., kv_tier_load_failures: _Optional[int] = ..., kv_tier_saves: _Optional[int] = ..., kv_tier_save_blocks: _Optional[int] = ..., kv_tier_save_failures: _Optional[int] = ..., kv_disk_loads: _Optional[int] = ..., kv_disk_load_blocks: _Optional[int] = ..., kv_disk_load_time_ns: _Optional[int] = ..., kv_disk_load_failures: _Optional[int] = ..., kv_disk_saves: _Optional[int] = ..., kv_disk_save_blocks: _Optional[int] = ..., kv_disk_save_failures: _Optional[int] = ..., kv_pool_loads: _Optional[int] = ..., kv_pool_load_blocks: _Optional[int] = ..., kv_pool_load_time_ns: _Optional[int] = ..., kv_pool_load_failures: _Optional[int] = ..., kv_pool_serves: _Optional[int] = ..., kv_pool_serve_blocks: _Optional[int] = ..., kv_pool_serve_failures: _Optional[int] = ..., kv_tier_load_bytes: _Optional[int] = ..., kv_disk_load_bytes: _Optional[int] = ..., kv_pool_load_bytes: _Optional[int] = ..., kv_tier_miss_blocks: _Optional[int] = ..., kv_tier_evictions: _Optional[int] = ..., kv_disk_evictions: _Optional[int] = ..., kv_store_lookups: _Optional[int] = ..., kv_store_hit_blocks: _Optional[int] = ..., kv_store_lookup_errors: _Optional[int] = ..., kv_store_lookup_timeouts: _Optional[int] = ..., kv_store_lookups_skipped: _Optional[int] = ..., kv_store_fetch_chosen: _Optional[int] = ..., kv_store_compute_chosen: _Optional[int] = ..., kv_store_loads: _Optional[int] = ..., kv_store_load_blocks: _Optional[int] = ..., kv_store_load_bytes: _Optional[int] = ..., kv_store_load_time_ns: _Optional[int] = ..., kv_store_load_failures: _Optional[int] = ..., kv_store_load_missing: _Optional[int] = ..., kv_store_bad_blocks: _Optional[int] = ..., kv_store_timeouts: _Optional[int] = ..., kv_store_save_blocks: _Optional[int] = ..., kv_store_save_dropped: _Optional[int] = ..., kv_store_put_written: _Optional[int] = ..., kv_store_put_failures: _Optional[int] = ..., kv_store_not_admitted: _Optional[int] = ..., kv_store_bad_deleted: _Optional[int] = ..., kv_pool_load_refusals: _Optional[int] = ..., kv_pool_serve_refusals: _Optional[int] = ..., kv_links: _Optional[_Iterable[_Union[KvLink, _Mapping]]] = ..., kv_encoded_pulls: _Optional[int] = ..., kv_encoded_bytes_saved: _Optional[int] = ..., kv_encoded_pull_refusals: _Optional[int] = ...) -> None: ...

class KvLink(_message.Message):
    __slots__ = ("peer", "bytes_per_s", "bytes_per_token", "samples", "age_s")
    PEER_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    AGE_S_FIELD_NUMBER: _ClassVar[int]
    peer: str
    bytes_per_s: float
    bytes_per_token: float
    samples: int
    age_s: float
    def __init__(self, peer: _Optional[str] = ..., bytes_per_s: _Optional[float] = ..., bytes_per_token: _Optional[float] = ..., samples: _Optional[int] = ..., age_s: _Optional[float] = ...) -> None: ...

class KvEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvEventBatch(_message.Message):
    __slots__ = ("seq", "cleared", "stored", "removed")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    CLEARED_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    seq: int
    cleared: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq: _Optional[int] = ..., cleared: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ...) -> None: ...

class KvSnapshotRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvSnapshot(_message.Message):
    __slots__ = ("seq", "block_hashes", "block_size", "worker_id")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    seq: int
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    worker_id: str
    def __init__(self, seq: _Optional[int] = ..., block_hashes: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., worker_id: _Optional[str] = ...) -> None: ...

class SetRoleRequest(_message.Message):
    __slots__ = ("role", "drain_timeout_ns")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_NS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    drain_timeout_ns: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., drain_timeout_ns: _Optional[int] = ...) -> None: ...

class SetRoleResponse(_message.Message):
    __slots__ = ("role", "changed", "num_aborted", "num_leases_released", "switch_ns")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_RELEASED_FIELD_NUMBER: _ClassVar[int]
    SWITCH_NS_FIELD_NUMBER: _ClassVar[int]
    role: Role
    changed: bool
    num_aborted: int
    num_leases_released: int
    switch_ns: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., changed: _Optional[bool] = ..., num_aborted: _Optional[int] = ..., num_leases_released: _Optional[int] = ..., switch_ns: _Optional[int] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("changed",)
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: bool
    def __init__(self, changed: _Optional[bool] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("unloaded",)
    UNLOADED_FIELD_NUMBER: _ClassVar[int]
    unloaded: bool
    def __init__(self, unloaded: _Optional[bool] = ...) -> None: ...

class StageWeightsRequest(_message.Message):
    __slots__ = ("model_path", "weight_version")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    weight_version: str
    def __init__(self, model_path: _Optional[str] = ..., weight_version: _Optional[str] = ...) -> None: ...

class StageWeightsResponse(_message.Message):
    __slots__ = ("num_tensors", "num_bytes", "stage_ns")
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    STAGE_NS_FIELD_NUMBER: _ClassVar[int]
    num_tensors: int
    num_bytes: int
    stage_ns: int
    def __init__(self, num_tensors: _Optional[int] = ..., num_bytes: _Optional[int] = ..., stage_ns: _Optional[int] = ...) -> None: ...

class CommitWeightsRequest(_message.Message):
    __slots__ = ("weight_version", "abort", "drain_timeout_ns")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_TIMEOUT_NS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    abort: bool
    drain_timeout_ns: int
    def __init__(self, weight_version: _Optional[str] = ..., abort: _Optional[bool] = ..., drain_timeout_ns: _Optional[int] = ...) -> None: ...

class CommitWeightsResponse(_message.Message):
    __slots__ = ("weight_version", "num_aborted", "commit_ns")
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_ABORTED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_NS_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    num_aborted: int
    commit_ns: int
    def __init__(self, weight_version: _Optional[str] = ..., num_aborted: _Optional[int] = ..., commit_ns: _Optional[int] = ...) -> None: ...

class DiscardWeightsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DiscardWeightsResponse(_message.Message):
    __slots__ = ("discarded",)
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    discarded: bool
    def __init__(self, discarded: _Optional[bool] = ...) -> None: ...

class TransferInitInfo(_message.Message):
    __slots__ = ("master_address", "master_port", "rank_offset", "world_size", "nccl_unique_id_b64", "packed", "packed_buffer_size_bytes", "packed_num_buffers")
    MASTER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    RANK_OFFSET_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    NCCL_UNIQUE_ID_B64_FIELD_NUMBER: _ClassVar[int]
    PACKED_FIELD_NUMBER: _ClassVar[int]
    PACKED_BUFFER_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PACKED_NUM_BUFFERS_FIELD_NUMBER: _ClassVar[int]
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    nccl_unique_id_b64: str
    packed: bool
    packed_buffer_size_bytes: int
    packed_num_buffers: int
    def __init__(self, master_address: _Optional[str] = ..., master_port: _Optional[int] = ..., rank_offset: _Optional[int] = ..., world_size: _Optional[int] = ..., nccl_unique_id_b64: _Optional[str] = ..., packed: _Optional[bool] = ..., packed_buffer_size_bytes: _Optional[int] = ..., packed_num_buffers: _Optional[int] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class TransferUpdateInfo(_message.Message):
    __slots__ = ("names", "dtype_names", "shapes", "tensor_sizes")
    NAMES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_NAMES_FIELD_NUMBER: _ClassVar[int]
    SHAPES_FIELD_NUMBER: _ClassVar[int]
    TENSOR_SIZES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    dtype_names: _containers.RepeatedScalarFieldContainer[str]
    shapes: _containers.RepeatedCompositeFieldContainer[TensorShape]
    tensor_sizes: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, names: _Optional[_Iterable[str]] = ..., dtype_names: _Optional[_Iterable[str]] = ..., shapes: _Optional[_Iterable[_Union[TensorShape, _Mapping]]] = ..., tensor_sizes: _Optional[_Iterable[int]] = ...) -> None: ...

class InitWeightTransferEngine(_message.Message):
    __slots__ = ("init_info",)
    INIT_INFO_FIELD_NUMBER: _ClassVar[int]
    init_info: TransferInitInfo
    def __init__(self, init_info: _Optional[_Union[TransferInitInfo, _Mapping]] = ...) -> None: ...

class StartWeightUpdate(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class UpdateWeights(_message.Message):
    __slots__ = ("update_info",)
    UPDATE_INFO_FIELD_NUMBER: _ClassVar[int]
    update_info: TransferUpdateInfo
    def __init__(self, update_info: _Optional[_Union[TransferUpdateInfo, _Mapping]] = ...) -> None: ...

class FinishWeightUpdate(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...

class UpdateWeightVersion(_message.Message):
    __slots__ = ("new_version",)
    NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
    new_version: str
    def __init__(self, new_version: _Optional[str] = ...) -> None: ...

class ShutdownWeightTransferEngine(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EngineWeightCallRequest(_message.Message):
    __slots__ = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update", "update_weight_version", "shutdown_weight_transfer_engine")
    INIT_WEIGHT_TRANSFER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    START_WEIGHT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    FINISH_WEIGHT_UPDATE_FIELD_NUMBER: _ClassVar[int]
    UPDATE_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHUTDOWN_WEIGHT_TRANSFER_ENGINE_FIELD_NUMBER: _ClassVar[int]
    init_weight_transfer_engine: InitWeightTransferEngine
    start_weight_update: StartWeightUpdate
    update_weights: UpdateWeights
    finish_weight_update: FinishWeightUpdate
    update_weight_version: UpdateWeightVersion
    shutdown_weight_transfer_engine: ShutdownWeightTransferEngine
    def __init__(self, init_weight_transfer_engine: _Optional[_Union[InitWeightTransferEngine, _Mapping]] = ..., start_weight_update: _Optional[_Union[StartWeightUpdate, _Mapping]] = ..., update_weights: _Optional[_Union[UpdateWeights, _Mapping]] = ..., finish_weight_update: _Optional[_Union[FinishWeightUpdate, _Mapping]] = ..., update_weight_version: _Optional[_Union[UpdateWeightVersion, _Mapping]] = ..., shutdown_weight_transfer_engine: _Optional[_Union[ShutdownWeightTransferEngine, _Mapping]] = ...) -> None: ...

class EngineWeightCallResponse(_message.Message):
    __slots__ = ("weight_version",)
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    weight_version: str
    def __init__(self, weight_version: _Optional[str] = ...) -> None: ...
