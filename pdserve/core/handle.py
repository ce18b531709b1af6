"""The KV handle a prefill hands to a decode (through the router), and the push
target the router names for a prefill. Plain values, importable without vLLM
(the router reads them)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.core.block_hash import DEFAULT_WEIGHT_VERSION


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
    # The weights version that computed the KV; a decode on another version refuses it.
    weight_version: str = DEFAULT_WEIGHT_VERSION

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
            "weight_version": self.weight_version,
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
                weight_version=str(params.get("weight_version", DEFAULT_WEIGHT_VERSION)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid KV handle {params!r}: {exc}") from exc


@dataclass(frozen=True)
class PushTarget:
    """Prefill: push this request's KV layer by layer to a decode's KV endpoint."""

    host: str
    port: int
    transfer_id: str

    def to_params(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "transfer_id": self.transfer_id}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PushTarget:
        try:
            return cls(str(params["host"]), int(params["port"]), str(params["transfer_id"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid KV push target {params!r}: {exc}") from exc


@dataclass(frozen=True)
class PoolSource:
    """Prefill: the peer whose host tier holds this prompt's first ``num_blocks``
    blocks (the cluster KV pool); its KV endpoint. Travels as
    ``kv_transfer_params["pool"]``."""

    host: str
    port: int
    num_blocks: int
    worker_id: str = ""

    def to_params(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "num_blocks": self.num_blocks,
                "worker_id": self.worker_id}

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> PoolSource:
        try:
            return cls(str(params["host"]), int(params["port"]), int(params["num_blocks"]),
                       str(params.get("worker_id", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid KV pool source {params!r}: {exc}") from exc
