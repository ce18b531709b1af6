"""What placement reads about a worker, and the bookkeeping it is built from.

``WorkerState`` is an immutable snapshot: the pool publishes a new one whenever
the worker reports (Health + GetLoad) or this router's in-flight work on it
changes, so a policy reading a list of snapshots sees one consistent moment.
``InFlight`` is that in-flight work; the dispatcher changes it only through the
``on_sent`` / ``on_finished`` hooks of the pool's ``Worker``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.core.lora import LoraAdapter, WantedLora
from pdserve.core.types import KvLink
from pdserve.router.dispatch.policies.tier_cost import NOT_MEASURED, KvLoadRates


@dataclass(frozen=True, slots=True)
class StepCost:
    """A worker engine's step time as it measured it (``GetLoad``'s step fit):
    ``base_s + per_seq_s * sequences decoding + per_token_s * prompt tokens``.
    ``decode_measured`` / ``prefill_measured``: the engine has run such steps (else
    that term is only the fit's prior)."""

    base_s: float
    per_seq_s: float
    per_token_s: float
    decode_measured: bool = False
    prefill_measured: bool = False

    def seconds(self, num_decode_seqs: int, num_prefill_tokens: int) -> float:
        return (self.base_s + self.per_seq_s * num_decode_seqs
                + self.per_token_s * num_prefill_tokens)


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """The part of a worker's ``GetLoad`` report that placement uses."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_inflight_reqs: int = 0
    step: StepCost | None = None  # None until the engine has measured a step
    # Its KV tiers' and the pool's measured loads (``tier_cost``), for their cost.
    kv_load: KvLoadRates = NOT_MEASURED
    # The rate its KV pulls from each peer came at (``link_cost``), for a handoff's price.
    kv_links: tuple[KvLink, ...] = ()

    @property
    def compute_s_per_token(self) -> float | None:
        """Seconds one prompt token adds to a step, once the engine has timed a prefill."""
        step = self.step
        return step.per_token_s if step is not None and step.prefill_measured else None


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One worker at one moment, as placement may read it (never mutated)."""

    endpoint: str
    role: str
    healthy: bool = False
    # The view's name for it (role/registered id; the endpoint stands in for a static
    # member's id): stable while it is a member, whatever id the worker reports.
    member_id: str = ""
    worker_id: str = ""
    compatibility_hash: str = ""
    model: str = ""  # the served model the worker reports (its Health)
    max_model_len: int = 0
    # KV endpoint, and whether the worker sends/accepts layer-wise push.
    kv_host: str = ""
    kv_port: int = 0
    kv_push: bool = False
    # Prompt tokens one request computes per engine step beside others (0: no cap).
    prefill_chunk_tokens: int = 0
    # The weights version it serves (its Health).
    weight_version: str = ""
    # Its cluster KV store (its Health: a hash of the store's address; "": none) and a
    # block's lifetime there: workers naming one store load each other's published blocks.
    kv_store_id: str = ""
    kv_store_ttl_s: float = 0.0
    # How it encodes the cluster KV pool's blocks (its Health: --kv-compression): a
    # pool pull is planned only between workers that name the same.
    kv_compression: str = "none"
    # The LoRA adapters it serves (its Health, after the router's replay of its own).
    loras: tuple[LoraAdapter, ...] = ()
    load: WorkerLoad = field(default_factory=WorkerLoad)
    # Requests this router has sent and not seen finish (fresher than GetLoad).
    num_assigned: int = 0
    # Prompt tokens this router has sent the worker to compute and not seen computed
    # (queued prefill work): a prefill worker's uncached tokens until the prefill
    # ends; a decode worker's local prefills until their first token.
    num_assigned_tokens: int = 0

    def serves(self, lora: WantedLora) -> bool:
        """Whether it can run a request under ``lora`` (None: the base model): that exact
        adapter (name and folder: a request's KV is only valid under its folder), or,
        given a name alone, an adapter of that name."""
        if lora is None:
            return True
        if isinstance(lora, str):
            return any(a.name == lora for a in self.loras)
        return lora in self.loras

    @property
    def id_known(self) -> bool:
        """Whether ``worker_id`` is the worker's own (registered, or named by its Health),
        not its endpoint standing in for a static member's until its first Health."""
        return self.worker_id != self.endpoint


class InFlight:
    """This router's requests on one worker: sent, not yet seen finish."""

    __slots__ = ("num_assigned", "num_assigned_tokens")

    def __init__(self) -> None:
        self.num_assigned = 0
        self.num_assigned_tokens = 0

    def on_sent(self, uncached_tokens: int) -> None:
        self.num_assigned += 1
        self.num_assigned_tokens += uncached_tokens

    def on_prefilled(self, uncached_tokens: int) -> None:
        self.num_assigned_tokens -= uncached_tokens

    def on_finished(self, uncached_tokens: int) -> None:
        self.num_assigned -= 1
        self.num_assigned_tokens -= uncached_tokens
