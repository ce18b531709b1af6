"""Typed messages between the connector's scheduler side and its worker side,
and the KV handle a prefill hands to a decode (through the router)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class KVHandle:
    """Where a prefill holds a request's KV; travels as ``kv_transfer_params``."""

    engine_id: str
    remote_request_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    transport: str
    host: str
    port: int
    transfer_id: str
    lease_deadline_unix_ns: int
    # The prefill also pushed the blocks, layer by layer, into the decode's inbox
    # under ``transfer_id``; the decode takes them from there (or pulls as before).
    pushed: bool = False

    def to_params(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "remote_request_id": self.remote_request_id,
            "block_ids": list(self.block_ids),
            "num_tokens": self.num_tokens,
            "transport": self.transport,
            "host": self.host,
            "port": self.port,
            "transfer_id": self.transfer_id,
            "lease_deadline_unix_ns": self.lease_deadline_unix_ns,
            "pushed": self.pushed,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> KVHandle:
        try:
            return cls(
                engine_id=str(params["engine_id"]),
                remote_request_id=str(params["remote_request_id"]),
                block_ids=tuple(int(b) for b in params["block_ids"]),
                num_tokens=int(params["num_tokens"]),
                transport=str(params["transport"]),
                host=str(params["host"]),
                port=int(params["port"]),
                transfer_id=str(params.get("transfer_id", "")),
                lease_deadline_unix_ns=int(params.get("lease_deadline_unix_ns", 0)),
                pushed=bool(params.get("pushed", False)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid KV handle {params!r}: {exc}") from exc


@dataclass(frozen=True)
class LeaseSpec:
    """Prefill: keep these blocks for a decode until ``deadline`` (time.time())."""

    block_ids: tuple[int, ...]
    deadline: float


@dataclass(frozen=True)
class LoadSpec:
    """Decode: pull ``src_block_ids`` of ``handle`` into our ``dst_block_ids``.

    ``first_position`` is the index of ``src_block_ids[0]`` in the handle's
    block list (blocks before it were local prefix-cache hits): pushed blocks
    are addressed by position, not by the prefill's block ids.
    """

    handle: KVHandle
    src_block_ids: tuple[int, ...]
    dst_block_ids: tuple[int, ...]
    first_position: int = 0


@dataclass(frozen=True)
class PushTarget:
    """Prefill: push this request's KV layer by layer to a decode's KV endpoint."""

    host: str
    port: int
    transfer_id: str

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PushTarget:
        try:
            return cls(str(params["host"]), int(params["port"]), str(params["transfer_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid KV push target {params!r}: {exc}") from exc


@dataclass(frozen=True)
class PushSpec:
    """Prefill, one step: after each layer is computed, send the blocks at
    positions ``first_position …`` (``block_ids``) of a request's
    ``num_blocks``-block prompt to ``target``. ``final``: this step computes
    the prompt's last tokens (earlier steps may leave their last block partial)."""

    target: PushTarget
    first_position: int
    block_ids: tuple[int, ...]
    num_blocks: int
    final: bool


@dataclass
class PdserveConnectorMetadata(KVConnectorMetadata):
    """One engine step's work for the worker side; rebuilt every step."""

    leases: dict[str, LeaseSpec] = field(default_factory=dict)
    loads: dict[str, LoadSpec] = field(default_factory=dict)
    releases: list[KVHandle] = field(default_factory=list)
    pushes: dict[str, PushSpec] = field(default_factory=dict)
    # Pushed transfers no decode will take (the prefill stopped at its first token).
    push_cancels: list[PushTarget] = field(default_factory=list)
    # Nothing is scheduled this step: the engine only steps to learn about transfers.
    idle: bool = False
