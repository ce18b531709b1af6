"""The request and worker types every part of pdserve speaks: the router, the
workers and the simulator. Plain frozen values; protobuf is converted to and
from them in one place (``pdserve.proto.convert``), at the gRPC edge.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION
from pdserve.core.handle import KVHandle, PoolSource, PushTarget
from pdserve.core.lora import LoraAdapter

Phase = Literal["prefill", "decode"]
Role = Literal["prefill", "decode"]
FinishReason = Literal["stop", "length", "abort", "error"]
PHASES: tuple[Phase, ...] = ("prefill", "decode")


StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar",
                         "structural_tag"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = ("json", "json_object", "regex", "choice",
                                                "grammar", "structural_tag")


@dataclass(frozen=True)
class StructuredOutput:
    """The grammar an output follows (vLLM's structured outputs). ``spec``: a JSON schema
    (JSON text) for ``json``, a regular expression, a JSON list of strings for ``choice``,
    an EBNF/Lark grammar, an xgrammar structural tag (JSON text, from vLLM's tool parsers);
    empty for ``json_object``."""

    kind: StructuredKind
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise ValueError(f"structured output kind must be one of {STRUCTURED_KINDS}")


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling parameters for one request (token-level only).

    Stop *strings* are not here: the router detokenizes and matches them itself,
    then closes the chunk iterator, which aborts the request on every worker.
    ``logprobs``: the sampled token's logprob and the top-k per output token (None:
    none); ``prompt_logprobs`` the same over the prompt, computed where it is computed.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    min_p: float = 0.0
    # Not a sampling parameter: rides with them to every phase and migration, as
    # ``structured`` does. Requests with different salts share no cached KV: vLLM hashes
    # it into the prompt's first block, pdserve's block names (``core.block_hash``) too.
    cache_salt: str | None = None
    # Not a sampling parameter either: the LoRA adapter the request runs (its OpenAI
    # ``model``; None: the base model). Riding here, it reaches prefill, decode and every
    # migration's continuation alike; the worker runs it and caches under it
    # (``core.lora.adapter_salt``).
    lora_name: str | None = None
    # The adapter's folder (with ``lora_name``, its exact identity): a worker that serves
    # the name from another folder refuses the request (ABORTED: run it elsewhere).
    lora_path: str | None = None


@dataclass(frozen=True)
class TokenLogprobs:
    """One position's logprobs: the token there and the candidates the engine reported,
    ``(token_id, logprob, rank)`` in its order (the token first, then the top-k by rank;
    rank 1 is the most likely). A prompt's first position has no entries."""

    token_id: int
    entries: tuple[tuple[int, float, int], ...] = ()


@dataclass(frozen=True)
class PhaseRequest:
    """One phase of a request, as the router sends it to a worker.

    Prefill: ``prompt_token_ids`` is the prompt; the worker returns the first
    token and, when ``sampling.max_tokens > 1``, a KV handle. ``push_target``
    asks it to push the KV layer by layer to a decode worker.
    Decode: ``prompt_token_ids`` is prompt + first token; ``kv_handle`` (if any)
    says where the prompt's KV is held.
    """

    request_id: str
    phase: Phase
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingSpec
    kv_handle: KVHandle | None = None
    push_target: PushTarget | None = None
    # Prefill: a peer's host tier holds the prompt's leading blocks (the KV pool).
    pool_source: PoolSource | None = None
    # The last this-many prompt tokens are output the request already produced (prefill's
    # first token; what was sent before a migration): the engine counts them as output
    # for penalties, min_tokens and the grammar, so the call continues the request.
    num_output_in_prompt: int = 0
    # The weights version the router admitted the request under ("": any).
    weight_version: str = ""
    # On the worker: the time its caller gave the call (the gRPC deadline, which is
    # the router's request deadline), None without one. Not sent: the call carries it.
    timeout_s: float | None = None


@dataclass(frozen=True)
class PhaseTiming:
    """Where one phase's time went on its worker (``GenerateResponse.timing``).

    Timestamps are wall-clock ns, so the router can join two workers (the
    handoff); durations come from one clock. 0 means "not measured".
    ``queue_ns`` of a decode that loads KV includes ``kv_load_ns``.
    """

    admitted_unix_ns: int = 0
    first_token_unix_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    kv_load_ns: int = 0


@dataclass(frozen=True)
class PhaseOutput:
    """Tokens since the previous output; the last one has ``finish_reason``
    (and ``timing``, from workers that measure it)."""

    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    kv_handle: KVHandle | None = None
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    timing: PhaseTiming | None = None
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per token of token_ids, when asked
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()  # the first output's, when asked
    # The first output of a call: the weights version producing all its tokens.
    weight_version: str = ""


@dataclass(frozen=True)
class WorkerHealth:
    """What a worker says about itself (``Health``)."""

    ready: bool
    role: Role
    worker_id: str
    model: str = ""
    dtype: str = ""
    block_size: int = 0
    max_model_len: int = 0
    transport: str = ""
    compatibility_hash: str = ""
    kv_host: str = ""
    kv_port: int = 0
    kv_push: bool = False
    metrics_endpoint: str = ""  # host:port of its /metrics listener; "" when off
    # Prompt tokens one request computes per step beside others (0: no cap).
    prefill_chunk_tokens: int = 0
    # The weights it serves: their version, and the folder last loaded ("": its model's).
    weight_version: str = DEFAULT_WEIGHT_VERSION
    weights_path: str = ""
    # Its cluster KV store (``core.kv_store_id``; "": none) and a block's lifetime there.
    kv_store_id: str = ""
    kv_store_ttl_s: float = 0.0
    # How it encodes the cluster KV pool's blocks (--kv-compression): pool pulls move
    # blocks only between workers that name the same.
    kv_compression: str = "none"
    # The LoRA adapters it serves now (empty: none, or LoRA off).
    loras: tuple[LoraAdapter, ...] = ()


@dataclass(frozen=True)
class KvLink:
    """The rate a worker's KV pulls from one peer came at (``kv_transfer/links.py``)."""

    peer: str  # the peer's KV endpoint, host:port
    bytes_per_s: float
    bytes_per_token: float
    samples: int
    age_s: float


@dataclass(frozen=True)
class WorkerLoadReport:
    """A worker's load and cumulative engine and KV-transfer counters (``GetLoad``)."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_pending_transfers: int = 0
    prompt_tokens_computed: int = 0
    prompt_tokens_local_cache_hit: int = 0
    prompt_tokens_external: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfers_completed: int = 0
    kv_transfers_failed: int = 0
    kv_transfer_time_ns: int = 0
    num_inflight_reqs: int = 0
    kv_leases_expired: int = 0
    kv_loads: int = 0
    kv_load_time_ns: int = 0
    kv_push_loads: int = 0
    kv_push_fallbacks: int = 0
    kv_layers_pushed: int = 0
    kv_pushes_failed: int = 0
    num_cached_blocks: int = 0
    kv_leases_held: int = 0
    kv_push_inbox_bytes: int = 0
    # The engine's fitted step time (GetLoad's step_* fields).
    step_base_us: int = 0
    step_per_seq_us: int = 0
    step_per_token_ns: int = 0
    step_decode_samples: int = 0
    step_prefill_samples: int = 0
    # The host tier (--kv-offload-gib): GetLoad's kv_tier_* fields.
    kv_tier_loads: int = 0
    kv_tier_load_blocks: int = 0
    kv_tier_load_time_ns: int = 0
    kv_tier_load_failures: int = 0
    kv_tier_saves: int = 0
    kv_tier_save_blocks: int = 0
    kv_tier_save_failures: int = 0
    # The disk tier (--kv-disk-dir): GetLoad's kv_disk_* fields, the same counts.
    kv_disk_loads: int = 0
    kv_disk_load_blocks: int = 0
    kv_disk_load_time_ns: int = 0
    kv_disk_load_failures: int = 0
    kv_disk_saves: int = 0
    kv_disk_save_blocks: int = 0
    kv_disk_save_failures: int = 0
    # The cluster KV pool (GetLoad's kv_pool_*), bytes, misses and evictions per tier.
    kv_pool_loads: int = 0
    kv_pool_load_blocks: int = 0
    kv_pool_load_time_ns: int = 0
    kv_pool_load_failures: int = 0
    kv_pool_serves: int = 0
    kv_pool_serve_blocks: int = 0
    kv_pool_serve_failures: int = 0
    kv_tier_load_bytes: int = 0
    kv_disk_load_bytes: int = 0
    kv_pool_load_bytes: int = 0
    kv_tier_miss_blocks: int = 0
    kv_tier_evictions: int = 0
    kv_disk_evictions: int = 0
    # The cluster KV store (GetLoad's kv_store_*).
    kv_store_lookups: int = 0
    kv_store_hit_blocks: int = 0
    kv_store_lookup_errors: int = 0
    kv_store_lookup_timeouts: int = 0
    kv_store_lookups_skipped: int = 0
    kv_store_fetch_chosen: int = 0
    kv_store_compute_chosen: int = 0
    kv_store_loads: int = 0
    kv_store_load_blocks: int = 0
    kv_store_load_bytes: int = 0
    kv_store_load_time_ns: int = 0
    kv_store_load_failures: int = 0
    kv_store_load_missing: int = 0
    kv_store_bad_blocks: int = 0
    kv_store_timeouts: int = 0
    kv_store_save_blocks: int = 0
    kv_store_save_dropped: int = 0
    kv_store_put_written: int = 0
    kv_store_put_failures: int = 0
    kv_store_not_admitted: int = 0  # blocks --kv-store-admission kept from the store
    kv_store_bad_deleted: int = 0
    # Pool pulls refused between workers whose KV settings differ (--kv-compression,
    # layout): made here (recomputed) and refused here.
    kv_pool_load_refusals: int = 0
    kv_pool_serve_refusals: int = 0
    # The rate its KV pulls from each peer came at (the router prices handoffs with it).
    kv_links: tuple[KvLink, ...] = ()
    # P->D pulls made with encoded blocks (--kv-compression, where it pays), the wire
    # bytes they saved, and those a prefill refused to encode (pulled raw).
    kv_encoded_pulls: int = 0
    kv_encoded_bytes_saved: int = 0
    kv_encoded_pull_refusals: int = 0


@dataclass(frozen=True)
class KvChange:
    """One batch of a prefill worker's prefix-cache set changes, numbered by
    ``seq``; ``cleared`` applies before ``stored``/``removed``. A batch with no
    change is a heartbeat carrying the current seq."""

    seq: int
    cleared: bool = False
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    @property
    def is_heartbeat(self) -> bool:
        return not (self.cleared or self.stored or self.removed)


@dataclass(frozen=True)
class KvSnapshot:
    """Every block hash a prefill worker holds, as of batch ``seq``."""

    seq: int
    block_hashes: tuple[int, ...]
    block_size: int
    worker_id: str


@dataclass(frozen=True)
class WeightsStaged:
    """What a worker's ``StageWeights`` read."""

    num_tensors: int = 0
    num_bytes: int = 0
    stage_ns: int = 0


@dataclass(frozen=True)
class WeightsCommitted:
    """What a worker's ``CommitWeights`` did."""

    weight_version: str
    num_aborted: int = 0  # calls in flight aborted (policy abort, or past the drain)
    commit_ns: int = 0  # admission to serving the new weights


@dataclass(frozen=True)
class RoleSwitch:
    """What a worker's role switch (``SetRole``) did."""

    role: Role  # the role it serves now
    changed: bool  # False: it served that role already
    num_aborted: int = 0  # requests in flight past the drain timeout, aborted
    num_leases_released: int = 0  # KV leases past the drain timeout, released
    switch_ns: int = 0  # admission to serving the new role
